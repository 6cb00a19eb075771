"""Benchmarks and device probes of distanom (scripts, not part of the installed package).

A package only so that bench/tests can import its helpers; the scripts run as files
(`python3 bench/<script>.py`). bench imports distanom, never the reverse.
"""
