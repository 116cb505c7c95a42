"""Library sides of the moe track, one file per side (rules: hopperbench.tracks)."""
