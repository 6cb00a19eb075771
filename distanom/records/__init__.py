"""One owner per on-disk format of a run directory: a typed record, its writer and its
reader side by side, so the agent that writes a file and the report that reads it share
one schema.

- `steps`: steps/rank<R>.csv, one row per step (`StepRow`).
- `index`: index.jsonl, one line per written or dropped capture file (`IndexWritten`,
  `IndexDropped`, read back as `IndexRecord`).
- `status`: status.json, the live state rank 0 rewrites (`Status`), and `job_alive`.
- `run_info`: run.json, the facts of the run (`RunInfo`).
- `requests`: requests/<id>.json and <id>.response.json (`Request`, `Accepted`, `Refused`).

Where files live and how they are written atomically is `distanom.rundir`'s; no torch here.
"""
