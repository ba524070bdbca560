"""``data convert`` into a folder it cannot write, or onto a full disk: the path and the cause.

Run in real processes: a read-only folder (``chmod 555``; as root, with the capability to
override permissions dropped, which ``setpriv`` does) and a file size limit
(``RLIMIT_FSIZE``, what a full disk looks like to one writer: ``EFBIG``).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
from ase.io import read, write

from ._support import TRAIN, assert_user_error

CLI = [sys.executable, "-m", "nvalchemi.training.cli", "data", "convert"]


def _run(command, **kwargs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    env.pop("NVALCHEMI_DEBUG", None)
    return subprocess.run(
        command, capture_output=True, text=True, timeout=240, env=env, check=False, **kwargs
    )


def _unprivileged(command):
    """``command`` without root's power to write into read-only folders."""
    if os.geteuid() != 0:
        return command
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot drop CAP_DAC_OVERRIDE")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *command]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "in.extxyz"
    write(path, read(TRAIN, index=":200"), format="extxyz")
    return path


def test_a_read_only_folder_is_named_with_the_cause(tmp_path, source):
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        for output in (folder / "out.zarr", folder / "new" / "out.zarr"):
            result = _run(_unprivileged([*CLI, str(source), str(output)]))
            assert_user_error(
                result,
                f"OUTPUT: cannot write {output}: {folder} is not writable for you "
                "(permission denied)",
                fix="a folder you can write to",
            )
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)


def test_a_full_disk_is_named_and_leaves_nothing(tmp_path, source):
    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    output = tmp_path / "out.zarr"
    result = _run([*CLI, str(source), str(output)], preexec_fn=limit_file_size)
    assert_user_error(
        result,
        f"OUTPUT: cannot write {output}: a file of the store would exceed the largest file "
        "size allowed here",
        "nothing was written (the partial store was removed)",
        fix="raise the limit",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.extxyz"]
