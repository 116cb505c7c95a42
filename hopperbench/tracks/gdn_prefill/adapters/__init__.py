"""Library sides of the gdn_prefill track, one file per side (rules: hopperbench.tracks)."""
