"""Demo adapters and the `make serve` entry point."""
