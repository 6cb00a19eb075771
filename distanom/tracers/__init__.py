"""Tracer backends behind one protocol (see `base`); `select` picks one for this process."""
