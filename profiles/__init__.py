"""Profile sweep results and the kernel selection tables the runtime reads (package data)."""
