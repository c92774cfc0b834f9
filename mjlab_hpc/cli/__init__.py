"""The commands: `mjlab-train` (`train`), `mjlab-submit` (`submit`), `mjlab-hpc` (`hpc`),
sharing parsing and error handling (`common`)."""
