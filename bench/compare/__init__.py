"""Side-by-side benchmark of gpuckpt against other checkpoint systems (see README.md here)."""
