"""hloserve.runtime: load artifacts through PJRT and run them (never imports torch)."""
