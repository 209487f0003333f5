"""What a person looks at: plotly figures (pure DataFrame -> Figure functions), the explorer widgets, the HTML
report and the Chrome/Perfetto trace export."""
