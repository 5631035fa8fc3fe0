"""Reading PEFT adapter directories: file-level checks (files.py); parsing is in ../format.py."""
