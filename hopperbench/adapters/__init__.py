"""Adapters: public Hopper libraries behind a definition's destination-passing signature.

One file per library side, named by `tracks.LibrarySide.entry` (`<file>::<function>`).
Each file exposes `run(<inputs in definition order>, <outputs>) -> None` and writes its
results into the given output tensors.

Rules every adapter follows:
- **Self-contained.** `sides.py` hands the file alone to flashinfer-bench's Python
  builder, which imports it from a temporary package: import only the standard library,
  `torch` and the library itself, never `hopperbench`.
- **Lazy library import.** The library is an optional extra; importing the adapter must
  work without it, and the first call raises one clear error when it is missing or of
  another version than the one the adapter was written for.
- **Conversion inside the call.** Layout changes, gate pre-processing and the copies into
  the destination tensors are part of what a user of the library pays, so they run (and
  are timed) inside `run`.
"""
