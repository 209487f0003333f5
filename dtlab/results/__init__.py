"""A run directory -> numbers: the one strict reader of what ranks wrote (`status`, `events`), the `Run` with its
DataFrames and summaries (`run`), derived views (`stragglers`: who waited for whom; `crosscheck`, `restarts`,
`trace`), whether a launcher is still alive (`liveness`), and calibration directories -> profiles (`calibration`).
No processes are started here."""
