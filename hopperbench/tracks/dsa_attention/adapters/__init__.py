"""Library sides of the dsa_attention track, one file per side (rules: hopperbench.tracks)."""
