"""A tensor-parallel executor: rank 0 in the process the user started, ranks 1..N-1 spawned by it.

Rank 0 is what the scheduler talks to (the executor service, or the offline `LLM`): `TPExecutor`
has `ModelExecutor`'s interface (``info``, ``execute_model``, ``reset``, ``shutdown``). For each
step it broadcasts the `SchedulerOutput`'s msgpack bytes to the other ranks over the process group
(`executor.parallel.TensorParallel.send_command`; never over Redis), then runs its own shard; every
rank runs the same step on its shard and rank 0 samples. Ranks rendezvous through a TCP store on
127.0.0.1 (one machine: multi-node tensor parallelism is not supported).

The ranks live and die as one unit, so the fault tolerance of the services sees one executor:

- rank 0 watches its children; when one exits, rank 0 exits too (``fatal_peer_death``, the
  service) or refuses every later step (the offline `LLM`, which must not kill its caller);
- ranks > 0 exit when rank 0 does (``PR_SET_PDEATHSIG`` on Linux, and a parent-pid watch), and
  on any error they cannot share with rank 0 (an error both raise, such as a bad step, is not one);
- rank 0 failing amid a step (`TensorParallel.settle`: anything but a bad step's `ValueError`
  before the collectives, or a sampling error it shares) kills the others, which wait in a
  collective it will not join, and refuses later steps; the service then exits (`check_device`);
- ranks > 0 exit likewise (rank 0 then stops the unit), and on a step they cannot decode.
- An idle rank 0 pings the others well within the collectives' timeout.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.config import DEFAULT_MAX_NUM_SEQS, CacheConfig, ModelConfig, ParallelConfig
from common.protocol import ExecutorOutput, SchedulerOutput, decode, encode
from executor.model_config import load_config
from executor.model_executor import ModelExecutor, resolve_device_dtype
from executor.parallel import (
    CMD_PING,
    CMD_RESET,
    CMD_STEP,
    CMD_STOP,
    COLLECTIVE_TIMEOUT,
    PeerStepFailed,
    ShardLayout,
    StepPhase,
    TensorParallel,
    check_divisible,
)

logger = logging.getLogger("conveyor.executor.tp")

PING_INTERVAL_S = 30.0  # idle ranks hear from rank 0 this often (far below COLLECTIVE_TIMEOUT)
WATCH_INTERVAL_S = 0.2  # how often rank 0 checks its children (and they their parent)


def build_executor(
    model_config: ModelConfig,
    parallel_config: ParallelConfig,
    cache_config: CacheConfig | None = None,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    fatal_peer_death: bool = False,
) -> ModelExecutor | TPExecutor:
    """A `ModelExecutor`, or a `TPExecutor` when ``tensor_parallel_size > 1``."""
    parallel_config.validate()
    if parallel_config.tensor_parallel_size == 1:
        return ModelExecutor(model_config, parallel_config, cache_config, max_num_seqs=max_num_seqs)
    return TPExecutor(model_config, parallel_config, cache_config or CacheConfig(), max_num_seqs, fatal_peer_death)


def rank_device(model_config: ModelConfig, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` on CUDA (one GPU per rank), else the CPU."""
    device, _ = resolve_device_dtype(model_config)
    if device.type != "cuda":
        return device
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


class TPExecutor:
    """Rank 0 of a tensor-parallel executor (see the module docstring)."""

    def __init__(
        self,
        model_config: ModelConfig,
        parallel_config: ParallelConfig,
        cache_config: CacheConfig,
        max_num_seqs: int,
        fatal_peer_death: bool,
    ) -> None:
        model_config.validate()
        cache_config.validate()
        world = parallel_config.tensor_parallel_size
        cfg = load_config(model_config.model)
        check_divisible(cfg, world)  # before any process starts
        if dist.is_initialized():  # torch.distributed has one default group per process
            raise ValueError("one tensor-parallel executor per process: shut the other one down first")
        device = rank_device(model_config, 0)
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs, found {torch.cuda.device_count()}")
        self.fatal_peer_death = fatal_peer_death
        self.dead: str | None = None  # why the executor can no longer run steps
        self.closing = threading.Event()
        self.lock = threading.Lock()  # one command at a time on the control channel
        self.last_command = time.monotonic()
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        args = (
            world,
            store.port,
            model_config,
            parallel_config,
            cache_config,
            max_num_seqs,
            os.getpid(),
            # PR_SET_PDEATHSIG fires when the spawning *thread* exits: only safe from the main thread.
            threading.current_thread() is threading.main_thread(),
            logger.getEffectiveLevel(),
        )
        self.procs = [
            ctx.Process(target=worker_main, args=(rank, *args), daemon=True, name=f"conveyor-tp-rank{rank}")
            for rank in range(1, world)
        ]
        for p in self.procs:
            p.start()
        self.pids = [os.getpid()] + [p.pid or 0 for p in self.procs]
        # Tests (and operators) find the ranks here, e.g. to kill one.
        logger.info("tensor parallel: %d ranks, pids %s", world, " ".join(str(pid) for pid in self.pids))
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        try:
            self._wait_for_ranks(store, world)
            TensorParallel.init_group(0, world, store, device)
            self.tp = TensorParallel(0, world, ShardLayout.build(cfg, 0, world), device)
            self.inner = ModelExecutor(model_config, parallel_config, cache_config, self.tp, max_num_seqs)
        except BaseException:
            self._stop_workers()
            raise
        self.info = self.inner.info
        threading.Thread(target=self._keepalive, name="tp-ping", daemon=True).start()

    def _wait_for_ranks(self, store: dist.TCPStore, world: int) -> None:
        """Wait until every rank reached the store (a rank that dies first is reported, not waited for)."""
        keys = [f"rank{rank}-up" for rank in range(1, world)]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while not store.check(keys):
            if self.dead is not None:
                raise RuntimeError(self.dead)
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks did not start within {COLLECTIVE_TIMEOUT}")
            time.sleep(0.05)

    def _watch(self) -> None:
        while not self.closing.wait(WATCH_INTERVAL_S):
            for rank, p in enumerate(self.procs, 1):
                if p.exitcode is None:
                    continue
                if self.dead is not None:  # the unit stopped already (out of step): for the record
                    logger.warning("tensor-parallel rank %d (pid %s) exited with code %s", rank, p.pid, p.exitcode)
                    return
                self.dead = f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                if self.closing.is_set():
                    return
                logger.error("%s: the executor stops as one unit", self.dead)
                self._stop_workers(grace_s=0.0)
                if self.fatal_peer_death:
                    logging.shutdown()
                    os._exit(1)
                return

    def _keepalive(self) -> None:
        while not self.closing.wait(PING_INTERVAL_S / 3):
            if time.monotonic() - self.last_command > PING_INTERVAL_S and self.dead is None:
                self._command(CMD_PING)

    def _command(self, cmd: int, payload: bytes = b"") -> None:
        """Send one command (the caller holds no lock); none once the unit stopped."""
        with self.lock:
            if self.dead is None:
                self.tp.send_command(cmd, payload)
                self.last_command = time.monotonic()

    def _check(self) -> None:
        if self.dead is not None:
            raise RuntimeError(self.dead)

    def execute_model(self, output: SchedulerOutput) -> ExecutorOutput:
        """Run one step on every rank; rank 0's sampled tokens come back. An error that leaves the
        ranks out of step (`TensorParallel.settle`) stops the unit: the other ranks are killed
        (they wait in a collective rank 0 will not join) and later steps are refused."""
        self._check()
        payload = encode(output)
        with self.lock:
            self.tp.begin_step()
            try:
                self.tp.send_command(CMD_STEP, payload)
                self.last_command = time.monotonic()
                result = self.inner.execute_model(output)
            except BaseException as exc:
                why = self.tp.settle(exc)
                if why is not None:
                    self._stop_unit(why)
                raise
            if self.tp.phase != StepPhase.AGREED:  # (a bug: a step path that did not end the step)
                self._stop_unit("a step returned with the tensor-parallel ranks out of step")
                raise RuntimeError(self.dead)
            return result

    def _stop_unit(self, why: str) -> None:
        """The ranks are out of step: kill the others (they wait in a collective rank 0 will not
        join) and refuse every later step."""
        if self.dead is None:
            self.dead = why
            logger.error("%s: the executor stops as one unit", why)
            self._stop_workers(grace_s=0.0)

    def check_device(self) -> None:
        """Raise if the unit stopped (the service then exits, and its requests are recovered), or
        if rank 0's device broke (a rank whose device broke fails its collectives: the unit exits)."""
        self._check()
        self.inner.check_device()

    def reset(self) -> None:
        """Drop every request's state on every rank (on rank 0 alone once the unit stopped)."""
        if self.dead is None:
            self._command(CMD_RESET)
        self.inner.reset()

    def shutdown(self) -> None:
        """Stop the other ranks and free this one."""
        if self.closing.is_set():
            return
        self.closing.set()
        if self.dead is None:
            try:
                self._command(CMD_STOP)
            except RuntimeError:
                logger.warning("could not tell the ranks to stop; killing them")
        self._stop_workers()
        self.inner.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop_workers(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(1.0)


def _exit_with_parent(parent_pid: int, pdeathsig: bool) -> None:
    """End this process when ``parent_pid`` (rank 0) dies, however it dies."""
    if pdeathsig:
        try:  # Linux: the kernel sends SIGKILL when the parent (thread) exits: no polling delay
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # already gone before the prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_INTERVAL_S)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def worker_main(
    rank: int,
    world: int,
    port: int,
    model_config: ModelConfig,
    parallel_config: ParallelConfig,
    cache_config: CacheConfig,
    max_num_seqs: int,
    parent_pid: int,
    pdeathsig: bool,
    log_level: int,
) -> None:
    """Rank ``rank`` > 0: load its shard, then run whatever rank 0 broadcasts until told to stop."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    # A terminal's Ctrl-C reaches the whole process group: rank 0 handles it (a step interrupted
    # there stops the unit, one between steps does not); here it would end a rank for nothing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent_pid, pdeathsig)
    try:
        device = rank_device(model_config, rank)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        store.set(f"rank{rank}-up", str(os.getpid()))
        TensorParallel.init_group(rank, world, store, device)
        tp = TensorParallel(rank, world, ShardLayout.build(load_config(model_config.model), rank, world), device)
        executor = ModelExecutor(model_config, parallel_config, cache_config, tp, max_num_seqs)
        serve_rank(tp, executor)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed; exiting (rank 0 follows)", rank)
        logging.shutdown()
        os._exit(1)
    logging.shutdown()
    os._exit(0)


def serve_rank(tp: TensorParallel, executor: Any) -> None:
    """The command loop of a rank > 0. An error rank 0 raised too (a bad step's `ValueError` before
    the collectives, or rank 0's failed sampling: `PeerStepFailed`) drops the state and goes on;
    any other error ends the rank (its state would differ from rank 0's, which reports only its
    own errors), and rank 0 stops the unit."""
    while True:
        cmd, payload = tp.recv_command()
        if cmd == CMD_STEP:
            output = decode(payload, (SchedulerOutput,))  # (rank 0 encoded it: it cannot be bad)
            tp.begin_step()
            try:
                executor.execute_model(output)
            except Exception as exc:
                # Rank 0 reports its own errors and the scheduler resets every rank; this rank's
                # errors reach no one. It goes on only after one rank 0 raised too: a bad step's
                # `ValueError` before any collective, or rank 0's failed sampling.
                if not (isinstance(exc, PeerStepFailed) or (isinstance(exc, ValueError) and tp.phase == StepPhase.STARTED)):
                    raise
                tp.end_step()
                logger.debug("step failed on every rank: %s", exc)
        elif cmd == CMD_RESET:
            executor.reset()
        elif cmd == CMD_STOP:
            return
        elif cmd != CMD_PING:
            raise RuntimeError(f"unknown tensor-parallel command {cmd}")
