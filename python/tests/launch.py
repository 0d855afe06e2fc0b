"""Runs a worker script under `kungfu-run -np N` for the tests.

    from launch import run_job
    job = run_job("workers/ops_worker.py", 4, str(tmp_path), log_dir=tmp_path)
    # raises AssertionError (with the job's output) unless it exited with 0

The launcher is `$KUNGFU_RUN`, default `<repo>/target/release/kungfu-run`;
the workers run `sys.executable`. Each job:

- gets a hard timeout (`timeout`, default 240 s): `kungfu-run --timeout`
  stops it first, and if that does not end it, this module does;
- is tagged with a fresh `KUNGFU_TEST_JOB=<random>` in its environment,
  which every worker and their children inherit. kungfu-run starts each
  worker in a process group of its own, so on a timeout, a failure or an
  interrupt the cleanup sends SIGTERM then SIGKILL to kungfu-run's process
  group, and then SIGKILL to every process that carries this job's tag
  (found in /proc/*/environ): only processes this job started, by pid;
- writes its combined output to a log file (in `log_dir`, e.g. pytest's
  `tmp_path`, else a fresh temporary directory), so that nothing is shared
  between tests that run in parallel. Ports are chosen by kungfu-run (the
  kernel's), never fixed here.

Workers import the package `kungfu` from where the test process does (its
directory goes first on their PYTHONPATH): an installed one, or the source
tree's python/ if none is installed or PYTHONPATH names it. OMP_NUM_THREADS
defaults to 1 (several workers share a few cores).
"""

import importlib.machinery
import os
import secrets
import signal
import site
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent.parent
PYTHON_DIR = REPO / "python"
TAG_VAR = "KUNGFU_TEST_JOB"
DEFAULT_TIMEOUT = 240.0
# shown on failure: the head and the tail of a long output
SHOW_HEAD = 6000
SHOW_TAIL = 24000


def kungfu_run() -> Path:
    """The launcher: $KUNGFU_RUN, else the release build in the repository."""
    return Path(os.environ.get("KUNGFU_RUN") or REPO / "target" / "release" / "kungfu-run")


def needs_repo_path() -> bool:
    """Whether `kungfu` is importable only from the source tree."""
    path = [p for p in sys.path if Path(p or ".").resolve() != PYTHON_DIR]
    # PathFinder, not importlib.util.find_spec: the latter answers from
    # sys.modules, where conftest may have put the source tree's kungfu
    return importlib.machinery.PathFinder.find_spec("kungfu", path) is None


def kungfu_home() -> Path:
    """The directory this process imports `kungfu` from (the source tree's
    python/ or site-packages)."""
    spec = importlib.machinery.PathFinder.find_spec("kungfu", sys.path)
    if spec is None or not spec.submodule_search_locations:
        return PYTHON_DIR
    return Path(list(spec.submodule_search_locations)[0]).resolve().parent


def worker_env(extra=None) -> dict:
    """The workers' environment: this one, with the `kungfu` this process
    imports first on PYTHONPATH (and the other entries made absolute: the
    workers run elsewhere)."""
    env = dict(os.environ)
    home = kungfu_home()
    site_dirs = {Path(p).resolve() for p in site.getsitepackages() + [site.getusersitepackages()]}
    entries = [] if home in site_dirs else [str(home)]
    entries += [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(entries))
    else:
        env.pop("PYTHONPATH", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class Job:
    cmd: list
    rc: int
    output: str
    log: Path
    seconds: float
    timed_out: bool

    def shown(self) -> str:
        out = self.output
        if len(out) > SHOW_HEAD + SHOW_TAIL:
            cut = len(out) - SHOW_HEAD - SHOW_TAIL
            out = f"{out[:SHOW_HEAD]}\n[... {cut} characters left out; the whole log: {self.log} ...]\n{out[-SHOW_TAIL:]}"
        what = "timed out" if self.timed_out else f"exited with {self.rc}"
        return (f"$ {' '.join(map(str, self.cmd))}\n"
                f"# {what} after {self.seconds:.1f} s; log: {self.log}\n{out}")


def _tagged(tag: str) -> list:
    """Pids of the live processes whose environment carries `tag`."""
    needle = f"{TAG_VAR}={tag}".encode()
    me = os.getpid()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in env.split(b"\0"):
            found.append(int(d.name))
    return found


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _sweep(tag: str) -> list:
    """SIGKILLs whatever this job left running; returns their pids."""
    left = _tagged(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return left


def _stop(proc: subprocess.Popen, tag: str) -> None:
    if proc.poll() is None:
        # kungfu-run forwards SIGTERM to the workers, and SIGKILLs them 3 s later
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=6)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    _sweep(tag)


def run(script, np: int, *args, timeout: float = DEFAULT_TIMEOUT, env=None,
        launcher_args=(), log_dir=None, name=None) -> Job:
    """Runs `python script args...` under `kungfu-run -np N`; returns the Job
    whatever its exit status (rc None: it timed out)."""
    script = Path(script)
    if not script.is_absolute():
        script = TESTS / script
    launcher = kungfu_run()
    if not launcher.is_file():
        raise FileNotFoundError(
            f"kungfu-run not found at {launcher}: build it (cargo build --release "
            "-p kungfu-tools --bin kungfu-run) or set KUNGFU_RUN")
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kungfu-test-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name or script.stem}-np{np}.log"
    tag = secrets.token_hex(8)
    full_env = worker_env(env)
    full_env[TAG_VAR] = tag
    cmd = [str(launcher), "-np", str(np), "--timeout", f"{int(timeout)}s", *launcher_args,
           "--", sys.executable, str(script), *map(str, args)]
    t0 = time.monotonic()
    timed_out = False
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=full_env,
                                cwd=str(log_dir), start_new_session=True)
        try:
            # kungfu-run's own --timeout comes first; this is the backstop
            proc.wait(timeout=timeout + 20)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if timed_out or proc.returncode != 0:
                _stop(proc, tag)
            else:
                _sweep(tag)
    seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    rc = None if timed_out else proc.returncode
    if rc == 124:
        timed_out = True
    return Job(cmd, rc, text, log, seconds, timed_out)


def run_job(script, np: int, *args, **kw) -> Job:
    """`run`, asserting that the job exited with 0 (the output shows if not)."""
    job = run(script, np, *args, **kw)
    assert job.rc == 0 and not job.timed_out, job.shown()
    return job


def saved_runs(out, tag: str, np: int) -> list:
    """What each of `np` ranks wrote with workers/model.save_result under
    `tag` in `out`: its JSON, with its flattened parameters as "params"."""
    import json

    import torch

    runs = []
    for r in range(np):
        data = json.loads((out / f"{tag}-rank{r}.json").read_text())
        data["params"] = torch.load(out / f"{tag}-rank{r}.pt")
        runs.append(data)
    return runs
