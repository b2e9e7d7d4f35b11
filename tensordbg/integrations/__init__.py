"""Ways into tensordbg besides attach(): tensordbg run (framework callbacks will join it)."""
