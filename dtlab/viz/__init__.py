"""What a person looks at: plotly figures (pure DataFrame -> Figure functions), the explorer widgets and the HTML
report."""
