"""Ready programs built on the FreeToken SDK."""
