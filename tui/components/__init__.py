"""The debugger's widgets, one per module."""
