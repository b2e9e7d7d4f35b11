"""The debugger's screens: the tabbed main screen, the session picker and the rule modals."""
