"""Progress on a terminal: redrawn in place, and a failed job's line is closed before the error."""

from __future__ import annotations

import io

from shardkit.checkpoint.offline.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_left_open_by_a_failure_is_closed_once():
    stream = _Tty()
    progress = Progress(stream=stream, interval=0)
    progress.start("reshard", 100)
    progress.update(10)
    assert stream.getvalue().startswith("\r\033[Kreshard") and not stream.getvalue().endswith("\n")
    progress.close()
    progress.close()
    assert stream.getvalue().endswith("\n") and stream.getvalue().count("\n") == 1


def test_a_finished_line_is_not_closed_twice():
    stream = _Tty()
    progress = Progress(stream=stream, interval=0)
    progress.start("convert", 10)
    progress.update(10)
    progress.finish()
    progress.close()
    assert stream.getvalue().count("\n") == 1 and "done in" in stream.getvalue()


def test_a_retried_file_write_is_counted_once(tmp_path, monkeypatch):
    """Storage retries a failed write from scratch (the chunks are loaded again): the progress still ends at
    the tensor data's size, not above it."""
    import torch
    from safetensors.torch import save_file

    from shardkit.checkpoint import reshard
    from shardkit.checkpoint.io.storage import Storage

    src = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(64, 32), "b": torch.randn(16)}, str(src))
    write_stream = Storage.write_stream

    def once_thrown_away(self, name, produce, **kwargs):
        if name.startswith("data/"):
            produce(io.BytesIO())  # a first attempt whose upload failed: its bytes are written again below
        return write_stream(self, name, produce, **kwargs)

    monkeypatch.setattr(Storage, "write_stream", once_thrown_away)
    progress = Progress(stream=io.StringIO())
    reshard(str(src), str(tmp_path / "out"), world_size=2, progress=progress)
    assert progress.done == (64 * 32 + 16) * 4
