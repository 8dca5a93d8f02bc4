"""What a serving process imports to use dflash2."""
