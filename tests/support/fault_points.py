"""`python tests/support/fault_points.py POINT K CUT VLINFER_ARGS...`: runs `python -m vlinfer
VLINFER_ARGS`
with one fault
planted in the batch job's output writing (vlinfer/captioning/output.py), at the K-th batch written
(1-based):
- mid-write: SIGKILL after the first CUT share of the batch reached the output (JSONL: that share of
  its bytes,
  fsync'ed; Parquet: the part's temporary file cut to that share);
- between: SIGKILL once the batch is whole in the output, before the next one starts;
- before-rename: SIGKILL with the Parquet part whole in its temporary file, not yet renamed into the
  folder;
- disk-full: the write fails with ENOSPC after the first CUT share reached the output, as on a full
  disk.

The kill is the process's own SIGKILL: no handler, no finally block, no buffer flushed runs after
it."""
import errno
import json
import os
import signal
import sys


def main() -> int:
    point, k, cut, argv = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
    import pyarrow.parquet as pq

    from vlinfer.captioning import output
    calls = {"jsonl": 0, "parquet": 0}

    def due(kind: str) -> bool:
        calls[kind] += 1
        return calls[kind] == k

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    write_records, write_table, replace = output.write_records, pq.write_table, os.replace

    def planted_write_records(f, records):
        if not due("jsonl"):
            return write_records(f, records)
        if point in ("mid-write", "disk-full"):
            data = "".join(json.dumps(r, ensure_ascii=False) + "\n"
                           for r in records).encode("utf-8")
            f.write(data[:int(len(data) * cut)])
            os.fsync(f.fileno())
            if point == "mid-write":
                die()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_records(f, records)
        if point == "between":
            die()

    def planted_write_table(table, where, *args, **kwargs):
        write_table(table, where, *args, **kwargs)
        if not due("parquet"):
            return
        if point in ("mid-write", "disk-full"):
            with open(where, "r+b") as f:
                f.truncate(int(os.path.getsize(where) * cut))
            if point == "mid-write":
                die()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if point == "before-rename":
            die()
        calls["rename"] = True  # "between": after the rename below

    def planted_replace(src, dst, *args, **kwargs):
        replace(src, dst, *args, **kwargs)
        if calls.pop("rename", False) and point == "between":
            die()

    output.write_records = planted_write_records
    pq.write_table = planted_write_table
    os.replace = planted_replace
    from vlinfer.cli import main as cli
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
