"""The dflash2d daemon process."""
