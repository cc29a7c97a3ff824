"""A real single-node SLURM cluster: the CI sub-DAG submitted through workflow/profiles/slurm.

The module fixture installs Debian's slurmctld/slurmd/slurm-client/munge when missing (root and
apt-get needed, skipped otherwise), starts munged if none answers, writes a slurm.conf into a
temporary folder (no accounting: no slurmdbd, no sacct data) and starts slurmctld and slurmd on
127.0.0.1 from it. slurmd runs configless (it fetches the conf from slurmctld and links it at
/run/slurm/conf): the slurm-jobstep plugin strips SLURM_CONF from the environment of the `srun`
it starts inside each job, and that is where srun looks next.

`snakemake --profile workflow/profiles/slurm outputs/learning/sft/resume-check.json` then runs
prepare -> base_model -> sft_{interrupt,continuous,resume} -> sft_resume_check as SLURM jobs in a
copy of the workflow, and the same target runs locally (--cores 2) in a second copy: every file
named by every manifest must have the same sha256 in both, and the resume check must say PASS.
A second test gives a long pretraining a 1-minute time limit: through the profile's retries and
its in-rule checkpoints it must end with the base model of a local uninterrupted run.

Only what the local test needs is on the command line, not in the profile: the status command
(squeue, since sacct has no accounting to ask) and a short delay before the first status check.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import copy_workflow, snakemake

from reprorl.core.manifest import read_json, sha256_file

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(3600)]

TARGET = "outputs/learning/sft/resume-check.json"
RULES = ("prepare", "base_model", "sft_interrupt", "sft_continuous", "sft_resume",
         "sft_resume_check")
PROFILE = "workflow/profiles/slurm"
# what only this local cluster needs: no accounting, so the plugin must poll squeue (and keep
# MinJobAge above 3x the first delay, see slurm.conf below); a short first delay saves minutes
LOCAL_TEST_FLAGS = ("--slurm-status-command", "squeue",
                    "--slurm-init-seconds-before-status-checks", "5")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
TOOLS = ("slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun",
         "munged", "munge", "unmunge")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_SOCKET_DIR = Path("/run/munge")
SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")
RUN_SLURM_CONF = Path("/run/slurm/conf")  # where slurmd links its configless cache


def sh(*command: str, env: dict | None = None, timeout: float = 30, check: bool = True,
       input: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                            input=input, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


def wait_for(what: str, predicate, timeout: float, logs: tuple[Path, ...] = ()):
    """Poll `predicate` until it returns something truthy; fail with the logs after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(1)
    tails = "\n".join(f"--- {log}:\n{log.read_text()[-3000:]}" for log in logs if log.is_file())
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})"
                         f"\n{tails}")


def install_slurm() -> None:
    if all(shutil.which(tool) for tool in TOOLS):
        return
    if os.geteuid() != 0:
        pytest.skip("SLURM is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        pytest.skip("SLURM is not installed and apt-get is not available to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    command = ("apt-get", "install", "-y", "--no-install-recommends", *PACKAGES)
    result = sh(*command, env=env, timeout=900, check=False)
    if result.returncode != 0:  # a stale package list: refresh it once
        sh("apt-get", "update", env=env, timeout=600)
        sh(*command, env=env, timeout=900)
    missing = [tool for tool in TOOLS if not shutil.which(tool)]
    assert not missing, f"installed {PACKAGES} but {missing} are still missing"


def munge_works() -> bool:
    credential = sh("munge", "-n", check=False, timeout=10)
    if credential.returncode != 0:
        return False
    return sh("unmunge", input=credential.stdout, check=False, timeout=10).returncode == 0


def start_munge(logdir: Path) -> subprocess.Popen | None:
    """Start munged (as user munge) unless one already answers; None if it was running."""
    if munge_works():
        return None
    if not MUNGE_KEY.is_file():
        MUNGE_KEY.parent.mkdir(mode=0o700, exist_ok=True)
        MUNGE_KEY.write_bytes(os.urandom(1024))
        shutil.chown(MUNGE_KEY.parent, "munge", "munge")
        shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_KEY.chmod(0o400)
    if not MUNGE_SOCKET_DIR.is_dir():
        MUNGE_SOCKET_DIR.mkdir(mode=0o755)
        shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
    log = (logdir / "munged.out").open("w")
    process = subprocess.Popen(["munged", "--foreground"], user="munge", group="munge",
                               extra_groups=[], stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    wait_for("munged", lambda: process.poll() is not None or munge_works(), 30)
    assert process.poll() is None, (logdir / "munged.out").read_text()
    return process


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def node_hardware() -> str:
    """This machine's CPUs, topology and RealMemory, as slurmd itself measures them."""
    line = sh("slurmd", "-C").stdout.splitlines()[0]
    keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore",
            "RealMemory")
    fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
    return " ".join(f"{key}={fields[key]}" for key in keys if key in fields)


def slurm_conf(state: Path, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
# generated by tests/test_slurm.py: one node (this machine), one partition, no accounting
ClusterName=reprorltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# slurmd fetches this file from slurmctld and links it at /run/slurm/conf for srun in jobs
SlurmctldParameters=enable_configless
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# squeue keeps finished jobs this long: the plugin's squeue status needs >= 3x its first delay
MinJobAge=600
ReturnToService=2
InactiveLimit=0
KillWait=10
NodeName=localhost NodeAddr=127.0.0.1 {node_hardware()} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def stop(process: subprocess.Popen | None, name: str) -> None:
    """Stop one daemon this module started, by its pid."""
    if process is None or process.poll() is not None:
        return
    os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        print(f"{name} (pid {process.pid}) ignored SIGTERM for 30 s: killing it")
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A running single-node cluster; yields the environment that reaches it (SLURM_CONF)."""
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld, slurmd and munged needs root")
    # Debian puts the daemons in /usr/sbin, which a minimal PATH (CI's, cron's) leaves out
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([*path, *(d for d in SBIN if d not in path)])
    install_slurm()
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("/etc/slurm/slurm.conf exists: this machine belongs to another SLURM "
                    "cluster, and srun inside the jobs would read that file")
    if RUN_SLURM_CONF.exists() or RUN_SLURM_CONF.is_symlink():
        pytest.skip(f"{RUN_SLURM_CONF} exists: a configless slurmd already runs here")

    state = tmp_path_factory.mktemp("slurm")
    for folder in ("ctld", "spool"):
        (state / folder).mkdir()
    ctld_port = slurmd_port = free_port()
    while slurmd_port == ctld_port:
        slurmd_port = free_port()
    conf = state / "slurm.conf"
    conf.write_text(slurm_conf(state, ctld_port, slurmd_port))
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemon_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    logs = (state / "slurmctld.log", state / "slurmd.log", state / "slurmctld.out",
            state / "slurmd.out")
    run_slurm_existed = Path("/run/slurm").exists()
    munge_dir_existed = MUNGE_SOCKET_DIR.exists()
    munged = slurmctld = slurmd = None
    try:
        munged = start_munge(state)
        slurmctld = subprocess.Popen(
            ["slurmctld", "-D", "-f", str(conf)], env=dict(daemon_env, SLURM_CONF=str(conf)),
            stdout=(state / "slurmctld.out").open("w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        wait_for("slurmctld to answer", lambda: slurmctld.poll() is not None or
                 "UP" in sh("scontrol", "ping", env=env, check=False).stdout, 60, logs)
        assert slurmctld.poll() is None, "slurmctld exited:\n" + logs[0].read_text()[-3000:]
        slurmd = subprocess.Popen(
            ["slurmd", "-D", "-N", "localhost", "--conf-server", f"127.0.0.1:{ctld_port}"],
            env=daemon_env, stdout=(state / "slurmd.out").open("w"),
            stderr=subprocess.STDOUT, start_new_session=True)

        def node_state():
            assert slurmd.poll() is None, "slurmd exited:\n" + "\n".join(
                log.read_text()[-3000:] for log in logs[1::2] if log.is_file())
            return sh("sinfo", "-h", "-N", "-o", "%N %t", env=env, check=False).stdout.strip()

        wait_for("the node to be idle", lambda: node_state() == "localhost idle", 120, logs)
        assert (RUN_SLURM_CONF / "slurm.conf").is_file(), "slurmd did not link its conf cache"
        print(f"\nSLURM cluster up: {sh('sinfo', env=env).stdout}")
        yield {"env": env, "state": state}
    finally:
        if slurmctld is not None and slurmctld.poll() is None:
            # cancel what a failed run left behind, so no slurmstepd outlives the cluster
            sh("scancel", "--user", "root", env=env, check=False)
            try:
                wait_for("cancelled jobs to leave", lambda: not sh(
                    "squeue", "-h", "--states=PENDING,RUNNING,COMPLETING", env=env,
                    check=False).stdout.strip(), 60)
            except AssertionError as error:
                print(error)
        stop(slurmd, "slurmd")
        stop(slurmctld, "slurmctld")
        stop(munged, "munged")
        if munged is not None and not munge_dir_existed and not any(MUNGE_SOCKET_DIR.iterdir()):
            MUNGE_SOCKET_DIR.rmdir()
        if RUN_SLURM_CONF.is_symlink() and str(state) in os.readlink(RUN_SLURM_CONF):
            RUN_SLURM_CONF.unlink()
            if not run_slurm_existed and not any(Path("/run/slurm").iterdir()):
                Path("/run/slurm").rmdir()


@pytest.fixture(scope="module")
def runs(slurm_cluster, tmp_path_factory):
    """The same target built through SLURM and locally, each in its own copy."""
    base = tmp_path_factory.mktemp("runs")
    on_slurm = copy_workflow(base / "slurm" / "wf")
    local = copy_workflow(base / "local" / "wf")
    # like conftest.snakemake: the copy's own src first, exported to every job (sbatch
    # --export=ALL), with SLURM_CONF pointing sbatch/squeue/scontrol at the test cluster
    env = dict(slurm_cluster["env"], PYTHONPATH=str(on_slurm / "src"),
               PYTHONDONTWRITEBYTECODE="1")
    for name in [k for k in env if k.startswith(("SLURM_JOB", "SBATCH_", "SRUN_"))]:
        del env[name]  # never submit from inside another job's environment
    command = [sys.executable, "-m", "snakemake", "--profile", PROFILE, TARGET,
               *LOCAL_TEST_FLAGS, "--configfile", "configs/ci.yaml"]
    started = time.monotonic()
    result = subprocess.run(command, cwd=on_slurm, env=env, capture_output=True, text=True,
                            timeout=1800, check=False)
    slurm_seconds = time.monotonic() - started
    (base / "slurm.log").write_text(result.stdout + result.stderr)
    print(f"\nSLURM run ({' '.join(command[2:])}) took {slurm_seconds:.0f} s "
          f"(exit {result.returncode}); log: {base / 'slurm.log'}")
    if result.returncode != 0:
        slurm_logs = "\n".join(f"--- {log}:\n{log.read_text()[-2000:]}" for log in
                               sorted((on_slurm / ".snakemake/slurm_logs").rglob("*.log")))
        raise AssertionError(f"SLURM run failed:\n{result.stdout[-5000:]}\n"
                             f"{result.stderr[-10000:]}\n{slurm_logs}")
    jobs = sh("squeue", "-h", "--states=all", "-o", "%i|%j|%T|%P", env=env).stdout.split()
    started = time.monotonic()
    snakemake(local, TARGET, "--configfile", "configs/ci.yaml", timeout=1800)
    print(f"local run (--cores 2) took {time.monotonic() - started:.0f} s")
    return {"slurm": on_slurm, "local": local, "log": result.stderr, "jobs": jobs}


def test_resume_check_passes_on_slurm_and_locally(runs):
    for where in ("slurm", "local"):
        check = read_json(runs[where] / TARGET)
        assert check["status"] == "PASS", (where, check)


def test_every_manifest_output_is_identical(runs):
    manifests = sorted(p.name for p in (runs["slurm"] / "outputs/manifests").glob("*.json"))
    assert manifests == sorted(p.name for p in (runs["local"] / "outputs/manifests").glob(
        "*.json"))
    assert manifests == sorted(f"{rule}.json" for rule in RULES)
    compared = 0
    for name in manifests:
        on_slurm = read_json(runs["slurm"] / "outputs/manifests" / name)["hashed"]
        local = read_json(runs["local"] / "outputs/manifests" / name)["hashed"]
        assert on_slurm["outputs"].keys() == local["outputs"].keys(), name
        assert on_slurm["outputs"], f"{name} names no output"
        for path, digest in on_slurm["outputs"].items():
            slurm_digest = sha256_file(runs["slurm"] / path)
            local_digest = sha256_file(runs["local"] / path)
            assert slurm_digest == digest, f"{path} changed after {name} was written (SLURM)"
            assert slurm_digest == local_digest, f"{path} differs between SLURM and local"
            compared += 1
        assert on_slurm == local, f"{name}: the hashed sections differ"
    print(f"\n{compared} output files of {len(manifests)} manifests identical")


def test_every_job_went_through_slurm(runs):
    log = runs["log"]
    submitted = log.count("has been submitted with SLURM jobid")
    assert submitted == len(RULES), log[-5000:]
    # the plugin's per-job SLURM logs (kept by the profile): one per rule, named by job id
    slurm_logs = runs["slurm"] / ".snakemake/slurm_logs"
    for rule in RULES:
        files = list((slurm_logs / f"rule_{rule}").glob("*.log"))
        assert len(files) == 1 and files[0].stem.isdigit(), (rule, files)
    # and slurmctld itself (squeue keeps finished jobs for MinJobAge; there is no sacct)
    ours = [job.split("|") for job in runs["jobs"] if "|reprorl_" in job]
    assert len(ours) == len(RULES), runs["jobs"]
    assert {state for _, _, state, _ in ours} == {"COMPLETED"}, ours
    assert {partition for *_, partition in ours} == {"debug"}, ours


def test_profile_names_only_rules_of_the_workflow(workflow_copy):
    """A misspelt rule under set-resources would silently keep the rule's defaults."""
    import yaml

    profile = yaml.safe_load((workflow_copy / PROFILE / "config.yaml").read_text())
    rules = set(snakemake(workflow_copy, "--list-rules").stdout.split())
    assert set(profile["set-resources"]) <= rules, set(profile["set-resources"]) - rules
    training = {r for r in rules if r == "base_model" or r.split("_")[0] in (
        "sft", "reward", "ppo", "grpo") and not r.endswith(("_check", "_report"))}
    assert {f"grpo_{run}_{mode}" for run in ("verifier", "learned")
            for mode in ("interrupt", "continuous", "resume")} <= training
    generation = {r for r in rules if r.startswith("generate_")}
    assert training | generation <= set(profile["set-resources"])
    for resources in profile["set-resources"].values():
        assert {"runtime", "mem_mb", "cpus_per_task"} <= set(resources), resources


# A stage given less time than it needs: the base model's pretraining made long enough (about
# 130 s of steps on 2 cores here) to outrun a 1-minute limit, which slurmctld enforces within
# about 30 s of its end (SIGTERM, then SIGKILL after KillWait).
LONG_STEPS = 3000
LONGER = ("--config", f"model={{pretrain: {{steps: {LONG_STEPS}}}}}")
STAGE = "outputs/manifests/base_model.json"


def test_a_stage_past_its_time_limit_finishes_through_retries(slurm_cluster, tmp_path):
    """Each attempt ends at its limit and the profile's `retries` resubmits it; the next
    continues from the in-rule checkpoint, and the base model is a local uninterrupted run's."""
    on_slurm = copy_workflow(tmp_path / "slurm" / "wf")
    local = copy_workflow(tmp_path / "local" / "wf")
    env = dict(slurm_cluster["env"], PYTHONPATH=str(on_slurm / "src"),
               PYTHONDONTWRITEBYTECODE="1")
    for name in [k for k in env if k.startswith(("SLURM_JOB", "SBATCH_", "SRUN_"))]:
        del env[name]
    command = [sys.executable, "-m", "snakemake", "--profile", PROFILE, STAGE,
               "--set-resources", "base_model:runtime=1", *LOCAL_TEST_FLAGS, *LONGER,
               "--configfile", "configs/ci.yaml"]
    started = time.monotonic()
    result = subprocess.run(command, cwd=on_slurm, env=env, capture_output=True, text=True,
                            timeout=1800, check=False)
    slurm_seconds = time.monotonic() - started
    slurm_logs = sorted((on_slurm / ".snakemake/slurm_logs/rule_base_model").glob("*.log"))
    assert result.returncode == 0, result.stderr[-5000:] + "\n".join(
        log.read_text()[-2000:] for log in slurm_logs)
    # an attempt may also end its steps as its limit strikes: counted failed (TIMEOUT), its
    # next attempt continues from the final state, kept as the last checkpoint
    limited = [log for log in slurm_logs if "DUE TO TIME LIMIT" in log.read_text()]
    assert limited and len(slurm_logs) >= 2, [log.name for log in slurm_logs]
    work = read_json(on_slurm / STAGE)["run"]["in_rule_checkpoints"]
    # an attempt its limit ends before the stage starts logs no start
    assert 1 < work["attempts"] <= len(slurm_logs) and work["steps_computed"] < 2 * LONG_STEPS
    snakemake(local, STAGE, *LONGER, "--configfile", "configs/ci.yaml", timeout=1800)
    hashed = read_json(on_slurm / STAGE)["hashed"]
    assert hashed == read_json(local / STAGE)["hashed"]
    for path, digest in hashed["outputs"].items():
        assert sha256_file(on_slurm / path) == digest == sha256_file(local / path), path
    print(f"\nbase model of {LONG_STEPS} steps under a 1-minute limit: {len(slurm_logs)} SLURM "
          f"jobs in {slurm_seconds:.0f} s, {work['steps_computed']} steps computed")
