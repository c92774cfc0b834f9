"""Operations on submitted runs, one module per `mjlab-hpc` subcommand (`status`, `logs`,
`cancel`, `plot`), on top of finding runs and their jobs (`runs`) and their states (`state`)."""
