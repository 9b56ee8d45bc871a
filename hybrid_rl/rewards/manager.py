"""Turn rollouts into token-level rewards with a per-sample score function."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import numbers
import os
import queue
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Callable

import numpy as np
import torch

from hybrid_rl.protocol import DataProtoView

from .custom import keyword_parameter
from .custom_manager import AbstractRewardManager
from .steps import decoded_prefix_lengths, token_at

__all__ = ["ON_ERROR_CHOICES", "RewardFunctionError", "RewardManager", "UnknownDataSourceError"]

logger = logging.getLogger(__name__)

ON_ERROR_CHOICES: tuple[str, ...] = ("zero", "raise")


# A batch's column of the scores that verl agent loops gave their rows (NaN where none did).
AGENT_SCORE_KEY = "agent_reward_score"


class RewardFunctionError(RuntimeError):
    """A reward function raised, timed out or returned a non-finite score for one sample."""


class UnknownDataSourceError(ValueError):
    """No reward function is registered for a sample's data source: a configuration error, so the
    reward manager always raises it, whatever ``on_error`` says."""


_FAILED = object()  # _call's result for a failed sample under on_error="zero"


class _RewardTimeout(Exception):
    """Internal: an async reward function was cancelled at its deadline."""


class _DaemonWorkers:
    """Daemon threads that run reward calls so the caller can stop waiting at a deadline.

    Like a ``ThreadPoolExecutor`` that reuses idle threads, but (1) a call that never returns only
    takes its own thread out of service, a new one is started for the next call instead of queueing
    behind it, and (2) the threads are daemons, so a hung reward function cannot keep the process
    from exiting (``ThreadPoolExecutor`` joins its threads at interpreter exit).
    """

    def __init__(self, name: str):
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward manager was closed")
            if self._idle:
                self._idle -= 1
            else:
                self._started += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True).start()
        self._jobs.put((future, fn))
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn = job
            del job
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as exc:  # handed to the waiting caller
                    future.set_exception(exc)
                    del exc
                else:
                    future.set_result(result)
                    del result
            del future, fn
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        """Idle threads exit now; a thread still running a timed-out call exits when it returns."""
        with self._lock:
            self._closed = True
            started = self._started
        for _ in range(started):
            self._jobs.put(None)


_pool_function: Callable | None = None  # in a scoring process: the reward function


def _start_scoring_process(pickled: bytes) -> None:
    global _pool_function
    import pickle

    _pool_function = pickle.loads(pickled)


def _started_process(_) -> None:
    time.sleep(0.1)  # long enough that each of the pool's processes takes one


def _score_in_process(kwargs: dict):
    result = _pool_function(**kwargs)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


class _ScoringProcesses:
    """Reward calls in worker processes (verl's prime and remote managers): CPU-bound functions run
    in parallel, and a call that runs past its deadline is stopped with its process (threads
    cannot be stopped). The function travels by value (cloudpickle), so one from a file of the
    user's needs no import in the workers."""

    def __init__(self, fn: Callable, processes: int):
        self.fn, self.processes, self._pool = fn, int(processes), None

    def _started(self):
        if self._pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            from ray import cloudpickle

            base = fn = self.fn
            while isinstance(base, functools.partial):
                base = base.func
            module = sys.modules.get(getattr(base, "__module__", None) or "")
            if module is not None and module.__name__.startswith("hybrid_rl_user_"):
                cloudpickle.register_pickle_by_value(module)  # a user's file: not importable by name
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("forkserver"),
                                             initializer=_start_scoring_process, initargs=(cloudpickle.dumps(fn),))
            # Every process started (its imports, the function loaded) before any call's deadline runs.
            list(self._pool.map(_started_process, range(self.processes)))
        return self._pool

    def run(self, calls: list[dict], timeout: float | None) -> list:
        """Each call's result, or the exception it raised (``_RewardTimeout`` past the deadline:
        ``timeout`` per call, calls beyond the pool's width given their own share)."""
        pool = self._started()
        futures = [pool.submit(_score_in_process, kwargs) for kwargs in calls]
        deadline = None if timeout is None else time.monotonic() + timeout * -(-len(calls) // self.processes)
        results, stuck = [], False
        for future in futures:
            try:
                results.append(future.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())))
            except FutureTimeoutError:
                results.append(_RewardTimeout("  (in a scoring process, stopped at the deadline)\n"))
                stuck = True
            except Exception as exc:  # noqa: BLE001  the function's own error, handed to the fault rules
                results.append(exc)
        if stuck:
            self.close()
        return results

    def close(self) -> None:
        if self._pool is not None:
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.kill()  # a hung call is stopped with its process
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _stack_of(thread_id: int | None) -> str:
    """Where a (hung) thread is now, without the worker machinery's frames."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return "  (the call had not started, or has just finished)\n"
    here = os.path.normcase(os.path.abspath(__file__))
    frames = [f for f in traceback.extract_stack(frame)
              if os.path.normcase(os.path.abspath(f.filename)) != here and not f.filename.endswith("threading.py")]
    return "".join(traceback.format_list(frames)) or "  (no frames outside the worker)\n"


def _fn_name(fn: Callable) -> str:
    base = fn
    while isinstance(base, functools.partial):
        base = base.func
    module = getattr(base, "__module__", None)
    qualname = getattr(base, "__qualname__", None) or getattr(base, "__name__", None) or repr(base)
    name = f"{module}.{qualname}" if module and not module.startswith("hybrid_rl_custom_reward_") else qualname
    return name + ("(partial)" if isinstance(fn, functools.partial) else "")


def _as_python(value: Any) -> Any:
    """numpy scalars/0-d arrays -> Python objects, so strings and dicts behave normally."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _sample(i: int, data_source, solution_str: str, ground_truth) -> str:
    """One sample, as an error names it."""
    return (f"sample index {i}, data_source={data_source!r}, ground_truth={ground_truth!r}, "
            f"response[:200]={solution_str[:200]!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (numbers.Real, np.bool_, np.number)) or (
        isinstance(value, torch.Tensor) and value.numel() == 1
    )


class RewardManager:
    """Per-sample ("naive") reward manager.

    For each row the valid response tokens are decoded, ``compute_score`` is
    called with keyword arguments ``data_source``, ``solution_str``,
    ``ground_truth`` and ``extra_info``, and the scalar score is written at the
    last valid response token; every other position is zero.

    ``compute_score`` may return a number (bool/int/float) or a dict with a
    ``"score"`` entry; extra dict keys are returned per sample in ``extra``.

    Process supervision: a dict with ``"step_rewards"`` (one float per reasoning step) and
    ``"step_ends"`` (each step's end as a character offset into the response, exclusive) puts
    each step's reward on the token holding the step's last character instead, and ``extra``
    then carries a (B, T) bool ``"step_mask"`` of those tokens (``"score"`` defaults to the sum).
    A process reward model's step rewards (a source with ``step_keys``) land the same way.

    Faults (``on_error``, ``timeout_s``; ``reward_model.on_error`` / ``reward_model.timeout_s``):

    * A call that raises, or that runs past ``timeout_s`` seconds, is a *failure*. With
      ``on_error="raise"`` it stops the run with :class:`RewardFunctionError` (naming the function,
      the sample index, data source and ground truth). With ``on_error="zero"`` the sample scores
      0.0, it is counted, and the first failure of this manager is logged once as a warning with
      its traceback (for a timeout: the stack where the call was stuck); later ones are only
      counted. ``self.failures`` is the number of failed samples in the last call,
      ``self.total_failures`` the running total, and with ``on_error="zero"`` ``extra`` carries a
      per-sample bool list ``"reward_failed"``.
    * Programming errors are not failures and always raise, whatever ``on_error`` says: a wrong
      return type, a dict without ``"score"``, malformed step rewards (``TypeError`` naming the
      function), a non-finite score (``RewardFunctionError`` naming the data source and sample
      index), and a data source no built-in scorer knows (:class:`UnknownDataSourceError`).
    * ``timeout_s`` (None or <= 0: no limit) is per call. With a limit each call runs in a daemon
      worker thread and the manager stops waiting at the deadline; Python cannot stop a thread, so
      a timed-out call keeps running in the background (its result is dropped) and the next call
      gets a fresh thread. Async reward functions are cancelled at the deadline. Code stuck in C
      without releasing the GIL can stall the whole process and is not covered; code that uses
      ``signal`` (e.g. ``signal.alarm``-based timeouts) only works in the main thread, so it fails
      when ``timeout_s`` is set. Without a limit calls run in the caller's thread, as before.

    An ``async`` reward function (no mixture) is awaited for all samples of a batch together, so
    requests it sends to a server (a served reward model, an API) are in flight at once; each is
    cancelled at its own ``timeout_s``. ``call_kwargs`` (the served reward model's
    ``reward_router_address`` and ``reward_model_tokenizer``) are passed to every function that
    takes them by name or through ``**kwargs``. ``extra_info_fields`` are added to every sample's
    ``extra_info`` (verl's gdpo manager adds the run's ``experiment_name``).

    ``batched`` (verl's batch manager, ``reward_model.reward_manager=batch``): ``compute_score`` is
    called once per batch, as ``fn(data_sources=[...], solution_strs=[...], ground_truths=[...],
    extra_infos=[...])``, and returns one result per sample in order; ``timeout_s`` is then the
    batch call's limit, and a failed call fails every sample of the batch.

    ``manager`` (verl's ``reward_manager.source=importlib``): a reward manager of the user's scores
    instead (`custom_manager.py`): a ``RewardManagerBase``'s ``run_single`` per row, awaited
    together (each under ``timeout_s``, its failures handled per sample as above); an
    ``AbstractRewardManager`` on the whole batch, its reward tensor taken as it is.

    ``processes`` (verl's prime and remote managers): the per-sample calls run in that many worker
    processes (started once, at the first batch), so CPU-bound functions run in parallel, and a
    call past ``timeout_s`` (calls beyond the pool's width get their own share) is stopped with
    its process, the pool started afresh.
    """

    def __init__(
        self,
        tokenizer,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        num_examine: int = 0,
        on_error: str = "raise",
        timeout_s: float | None = None,
        sources: list | None = None,
        extra_info_fields: dict | None = None,
        batched: bool = False,
        manager: Any = None,
        processes: int = 0,
    ):
        from . import default_compute_score

        if compute_score is None:
            compute_score = default_compute_score
        if not callable(compute_score):
            raise TypeError(f"compute_score must be callable, got {type(compute_score).__name__}")
        if on_error not in ON_ERROR_CHOICES:
            raise ValueError(f"reward_model.on_error must be one of {', '.join(map(repr, ON_ERROR_CHOICES))}, "
                             f"got {on_error!r}")
        if timeout_s is not None:
            try:
                timeout_s = float(timeout_s)
            except (TypeError, ValueError):
                raise ValueError(f"reward_model.timeout_s must be a number of seconds (or null for no limit), "
                                 f"got {timeout_s!r}") from None
            if math.isnan(timeout_s):
                raise ValueError("reward_model.timeout_s must be a number of seconds (or null for no limit), got nan")
            if timeout_s <= 0 or math.isinf(timeout_s):
                timeout_s = None
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.reward_fn_key = reward_fn_key
        self.num_examine = int(num_examine)
        self.on_error = on_error
        self.timeout_s = timeout_s
        self.failures = 0
        self.total_failures = 0
        self._logged_failure = False
        self._workers: _DaemonWorkers | None = None
        self._name = _fn_name(compute_score)
        self.sources = sources  # a weighted mixture (hybrid_rl.rewards.mixture) instead of compute_score
        self.sandbox_failures: dict[str, int] = {}
        self.call_kwargs: dict[str, Any] = {}
        self.extra_info_fields = dict(extra_info_fields or {})  # added to every sample's extra_info
        if batched and (sources is not None or compute_score is default_compute_score):
            raise ValueError("reward_model.reward_manager=batch calls one reward function of your own with the whole "
                             "batch; set custom_reward_function.path, and leave reward.funcs empty")
        self.batched = batched
        self.manager = manager  # a verl reward manager of the user's (custom_manager.py), which then scores
        if processes and (sources is not None or batched or manager is not None):
            raise ValueError("scoring in worker processes (verl's prime and remote reward managers) calls one "
                             "function per sample; it does not combine with reward.funcs, the batch manager or a "
                             "reward manager of your own")
        self._processes = _ScoringProcesses(compute_score, processes) if processes else None
        if manager is not None:
            self._name = type(manager).__name__

    def close(self) -> None:
        """Let the worker threads of ``timeout_s`` go (optional; they are daemon threads)."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None
        if self._processes is not None:
            self._processes.close()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_workers"] = None  # threads and locks do not pickle; a copy starts its own
        if self._processes is not None:
            state["_processes"] = _ScoringProcesses(self._processes.fn, self._processes.processes)
        return state

    # ------------------------------------------------------------------ helpers
    def _kwargs(self, fn: Callable, data_source, solution_str: str, ground_truth, extra_info) -> dict:
        kwargs = dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                      extra_info=extra_info)
        kwargs.update({key: value for key, value in self.call_kwargs.items() if keyword_parameter(fn, key)})
        return kwargs

    def _invoke(self, fn: Callable, kwargs: dict):
        """One call of the reward function, with the ``timeout_s`` deadline when there is one."""
        if self.timeout_s is None:
            result = fn(**kwargs)
            if inspect.isawaitable(result):
                result = asyncio.run(_await(result))
            return result

        timeout = self.timeout_s
        where: dict[str, int] = {}

        def run():
            where["thread"] = threading.get_ident()
            result = fn(**kwargs)
            if inspect.isawaitable(result):
                try:
                    result = asyncio.run(_await(result, timeout))
                except asyncio.TimeoutError:
                    raise _RewardTimeout() from None
            return result

        if self._workers is None:
            self._workers = _DaemonWorkers("reward-fn")
        future = self._workers.submit(run)
        try:
            return future.result(timeout=timeout)
        except FutureTimeoutError:
            raise _RewardTimeout(_stack_of(where.get("thread"))) from None

    def _call(self, i: int, data_source, solution_str: str, ground_truth, extra_info, fn: Callable | None = None):
        """The reward function's result, or ``_FAILED`` when it failed and ``on_error="zero"``."""
        fn = fn or self.compute_score
        try:
            return self._invoke(fn, self._kwargs(fn, data_source, solution_str, ground_truth, extra_info))
        except Exception as exc:
            return self._failure(exc, _fn_name(fn), _sample(i, data_source, solution_str, ground_truth))

    def _call_in_processes(self, samples: list[tuple]) -> list:
        """Every sample's result from the scoring processes; failures handled as in ``_call``."""
        calls = [self._kwargs(self.compute_score, data_source, solution_str, ground_truth, extra_info)
                 for _, solution_str, data_source, ground_truth, extra_info in samples]
        results = []
        for i, (result, (_, solution_str, data_source, ground_truth, _)) in enumerate(
                zip(self._processes.run(calls, self.timeout_s), samples)):
            if isinstance(result, Exception):
                result = self._failure(result, self._name, _sample(i, data_source, solution_str, ground_truth))
            results.append(result)
        return results

    def _call_batch(self, samples: list[tuple]) -> list:
        """verl's batch manager: one call of the reward function for all ``samples``, with lists
        (``data_sources``, ``solution_strs``, ``ground_truths``, ``extra_infos``); its results, one
        per sample (all ``_FAILED`` when the call failed under ``on_error="zero"``)."""
        fn = self.compute_score
        kwargs = {"data_sources": [s[2] for s in samples], "solution_strs": [s[1] for s in samples],
                  "ground_truths": [s[3] for s in samples],
                  # verl's adds the rollout's own scores (its agent loops'); a tool's reward is not kept here
                  "extra_infos": [{**(s[4] or {}), "rollout_reward_scores": {}} for s in samples]}
        kwargs.update({key: value for key, value in self.call_kwargs.items() if keyword_parameter(fn, key)})
        try:
            results = self._invoke(fn, kwargs)
        except Exception as exc:
            return [self._failure(exc, self._name, f"the batch of {len(samples)} samples", count=len(samples))] \
                * len(samples)
        if isinstance(results, (np.ndarray, torch.Tensor)):
            results = results.tolist()
        if not isinstance(results, (list, tuple)) or len(results) != len(samples):
            raise TypeError(f"reward function {self._name} (reward_model.reward_manager=batch) returned "
                            f"{type(results).__name__}" + (f" of {len(results)}" if isinstance(results, (list, tuple))
                                                            else "")
                            + f" for a batch of {len(samples)} samples; return a list with one score (a number, or a "
                            "dict with 'score') per sample, in order")
        return list(results)

    def _call_all(self, samples: list[tuple], batch=None) -> list:
        """An async reward function's results for all ``samples`` (ids, solution, data source,
        ground truth, extra info), awaited together; failures handled as in ``_call``. With a
        verl 0.9 reward manager of the user's (``manager``): its ``run_single`` on each row of
        ``batch``, its ``{"reward_score", "reward_extra_info"}`` as our ``{"score", ...}``."""
        rows = DataProtoView.of(batch) if self.manager is not None else None

        def start(i, sample):
            if self.manager is not None:
                return self.manager.run_single(rows[i:i + 1])
            _, solution_str, data_source, ground_truth, extra_info = sample
            return self.compute_score(**self._kwargs(self.compute_score, data_source, solution_str, ground_truth,
                                                     extra_info))

        async def one(i, sample):
            call = start(i, sample)
            try:
                return await (call if self.timeout_s is None else asyncio.wait_for(call, self.timeout_s))
            except asyncio.TimeoutError:
                raise _RewardTimeout() from None

        async def every():
            if self.manager is not None:
                self.manager.loop = asyncio.get_running_loop()  # verl's run_single hands work to self.loop
            return await asyncio.gather(*(one(i, sample) for i, sample in enumerate(samples)), return_exceptions=True)

        results = []
        for i, (result, (_, solution_str, data_source, ground_truth, _)) in enumerate(zip(asyncio.run(every()), samples)):
            if isinstance(result, Exception):
                result = self._failure(result, self._name, _sample(i, data_source, solution_str, ground_truth))
            elif isinstance(result, BaseException):
                raise result
            elif self.manager is not None:
                if not isinstance(result, dict) or "reward_score" not in result:
                    raise TypeError(f"reward manager {self._name}.run_single returned {type(result).__name__} "
                                    f"for sample {i}; return {{'reward_score': float, 'reward_extra_info': dict}}")
                result = {**(result.get("reward_extra_info") or {}), "score": result["reward_score"]}
            results.append(result)
        return results

    def _whole_batch(self, batch) -> tuple[torch.Tensor, dict[str, list]]:
        """A verl 0.3-0.8 reward manager of the user's: its reward tensor and values for the batch,
        from one call; a failed call fails every sample."""
        responses = batch["responses"]
        rows = len(responses)
        self.failures = 0
        extra: dict[str, list] = {}
        try:
            out = self._invoke(self.manager, {"data": DataProtoView.of(batch), "return_dict": True})
        except Exception as exc:
            self._failure(exc, self._name, f"the batch of {rows} samples", count=rows)
            return torch.zeros(responses.shape, dtype=torch.float32, device=responses.device), {
                "score": [0.0] * rows, "reward_failed": [True] * rows}
        reward, info = (out.get("reward_tensor"), out.get("reward_extra_info") or {}) if isinstance(out, dict) \
            else (out, {})
        if not isinstance(reward, torch.Tensor) or tuple(reward.shape) != tuple(responses.shape):
            raise TypeError(f"reward manager {self._name} returned a reward tensor of "
                            f"{tuple(reward.shape) if isinstance(reward, torch.Tensor) else type(reward).__name__}; "
                            f"it must be (batch, response length) = {tuple(responses.shape)}")
        reward = reward.to(dtype=torch.float32, device=responses.device)
        if not torch.isfinite(reward).all():
            raise RewardFunctionError(f"reward manager {self._name} returned non-finite rewards; rewards must be finite")
        extra["score"] = reward.sum(-1).tolist()
        for key, values in info.items():
            if len(values) != rows:
                raise TypeError(f"reward manager {self._name} returned {len(values)} values of {key!r} for a batch "
                                f"of {rows}")
            extra[key] = [_as_python(v) for v in values]
        if self.on_error == "zero":
            extra["reward_failed"] = [False] * rows
        return reward, extra

    def _failure(self, error: Exception, name: str, sample: str, count: int = 1):
        """``_FAILED`` for a failed call (for ``sample``, described, and ``count`` samples) under
        ``on_error="zero"`` (counted, the first one logged); raises ``RewardFunctionError`` under
        ``on_error="raise"``."""
        if isinstance(error, _RewardTimeout):
            cause = None
            what = f"exceeded reward_model.timeout_s={self.timeout_s:g} s"
            fix = ("raise reward_model.timeout_s (or set it to null for no limit) if the function needs more "
                   "time; " + ("its scoring process was stopped" if self._processes is not None else
                               "the timed-out call keeps running in a background thread"))
            stack = error.args[0] if error.args else "  (an async function, cancelled at the deadline)\n"
            details = f"\nThe call was at:\n{stack}"
        else:
            cause = error
            what = f"raised {type(error).__name__}: {error}"
            fix = details = ""
        if self.on_error == "raise" or isinstance(cause, UnknownDataSourceError):
            # an unknown data source is a configuration error: scoring it 0 would hide it
            raise RewardFunctionError(f"reward function {name} {what} ({sample})"
                                      + (f"; {fix}" if fix else "")) from cause
        self.failures += count
        self.total_failures += count
        if not self._logged_failure:
            self._logged_failure = True
            logger.warning(
                "reward function %s %s (%s). The sample scores 0 (reward_model.on_error=zero); this is logged "
                "once, later failures are only counted (reward/failed_samples). Set reward_model.on_error=raise "
                "to stop the run instead%s%s",
                name, what, sample, f"; {fix}" if fix else ".", details, exc_info=cause)
        return _FAILED

    def _step_positions(self, i: int, ids: list[int], solution_str: str, result: dict) -> list[tuple[int, float]]:
        """(token index, reward) of each step; a step ends on the token whose decoded prefix first
        reaches the step's end offset."""
        rewards, ends = result.get("step_rewards"), result.get("step_ends")
        if not isinstance(rewards, (list, tuple)) or not isinstance(ends, (list, tuple)) or len(rewards) != len(ends):
            raise TypeError(
                f"reward function {self._name} returned step_rewards/step_ends for sample {i} that are not "
                "two lists of equal length (one reward and one character end offset per step)")
        prefix_lengths = decoded_prefix_lengths(self.tokenizer, ids)
        positions = []
        for reward, end in zip(rewards, ends):
            if not _is_number(reward) or not math.isfinite(float(reward)):
                raise RewardFunctionError(f"reward function {self._name} returned step reward {reward!r} for "
                                          f"sample index {i}; step rewards must be finite numbers")
            if not isinstance(end, int) or not 0 < end <= len(solution_str):
                raise TypeError(f"reward function {self._name} returned step end {end!r} for sample {i}; ends "
                                f"are character offsets in 1..{len(solution_str)} (the response length)")
            positions.append((max(token_at(prefix_lengths, end), 0), float(reward)))
        return positions

    def _to_score(self, i: int, data_source, result, name: str | None = None) -> tuple[float, dict]:
        name = name or self._name
        extras: dict = {}
        if isinstance(result, dict) and "step_rewards" in result and "score" not in result:
            result = {**result, "score": float(sum(result["step_rewards"] or [0.0]))}
        if isinstance(result, dict):
            if "score" not in result:
                raise TypeError(
                    f"reward function {name} returned a dict without a 'score' key "
                    f"(keys: {sorted(map(str, result))}) for sample {i} (data_source={data_source!r}); "
                    "expected a float/int/bool or a dict containing 'score'"
                )
            extras = {k: _as_python(v) for k, v in result.items() if k != "score"}
            raw = result["score"]
            if not _is_number(raw):
                raise TypeError(
                    f"reward function {name} returned dict['score'] of type {type(raw).__name__} "
                    f"for sample {i} (data_source={data_source!r}); expected a float/int/bool"
                )
        elif _is_number(result):
            raw = result
        else:
            raise TypeError(
                f"reward function {name} returned {type(result).__name__} "
                f"for sample {i} (data_source={data_source!r}); "
                "expected a float/int/bool or a dict with a 'score' key"
            )
        score = float(raw.item() if isinstance(raw, torch.Tensor) else raw)
        if not math.isfinite(score):
            raise RewardFunctionError(
                f"reward function {name} returned a non-finite score ({score}) "
                f"for sample index {i}, data_source={data_source!r}; rewards must be finite numbers"
            )
        return score, extras

    # ------------------------------------------------------------------ mixture
    def _batch_source_scores(self, batch, solutions: list[str], ground_truths: list) -> dict[str, list[float]]:
        """Scores of the sources that take the whole batch at once (the code sandbox) or that
        were computed before (the reward model's, in the batch)."""
        scores = {}
        for source in self.sources or []:
            if source.batch_fn is not None:
                scores[source.name], failed = source.batch_fn(solutions, ground_truths)
                self.sandbox_failures[source.name] = int(sum(failed))
            elif source.batch_key is not None:
                if source.batch_key not in batch:
                    raise KeyError(f"reward source {source.name} reads the batch's {source.batch_key!r}, which it "
                                   f"does not have (available keys: {batch.keys()}); the reward model's workers "
                                   "compute it before the reward.")
                scores[source.name] = batch[source.batch_key].tolist()
        return scores

    def _mixture_result(self, i: int, data_source, solution_str: str, ground_truth, extra_info,
                        batch_scores: dict[str, list[float]]):
        """``{"score": sum of weight x score over the sources that scored, "reward/<name>": score or
        None}``, or ``_FAILED`` when a source failed under ``on_error="zero"``."""
        from .mixture import combine

        values = {}
        for source in self.sources:
            if source.fn is None:
                values[source.name] = batch_scores[source.name][i]
                continue
            result = self._call(i, data_source, solution_str, ground_truth, extra_info, fn=source.fn)
            if result is _FAILED:
                return _FAILED
            if result is None:  # the source abstains on this sample
                values[source.name] = None
                continue
            if isinstance(result, dict) and "step_rewards" in result:
                raise TypeError(f"reward source {source.name} returned step rewards for sample {i}; process "
                                "rewards need a single source (leave reward.funcs empty)")
            values[source.name] = self._to_score(i, data_source, result, name=source.name)[0]
        score = combine(list(values.values()), [source.weight for source in self.sources])
        return {"score": score, **{f"reward/{name}": value for name, value in values.items()}}

    # --------------------------------------------------------------------- call
    def __call__(self, batch) -> tuple[torch.Tensor, dict[str, list]]:
        reward, extra = self._score(batch)
        if AGENT_SCORE_KEY in batch:
            scored = torch.isfinite(batch[AGENT_SCORE_KEY])
            for i in scored.nonzero().flatten().tolist():  # as verl, the loop's score replaces the function's
                score = float(batch[AGENT_SCORE_KEY][i])
                reward[i] = 0.0
                reward[i, max(int(batch.response_lengths()[i]) - 1, 0)] = score
                extra["score"][i] = score
            if "step_mask" in extra:
                extra["step_mask"][scored] = False
        return reward, extra

    def _score(self, batch) -> tuple[torch.Tensor, dict[str, list]]:
        responses: torch.Tensor = batch["responses"]
        if responses.ndim != 2:
            raise ValueError(f"batch['responses'] must be (B, T), got shape {tuple(responses.shape)}")
        if isinstance(self.manager, AbstractRewardManager):
            return self._whole_batch(batch)
        bsz, resp_len = responses.shape
        # The whole response, in a multi-turn trajectory the tools' outputs too (response_mask
        # would leave those out).
        if "attention_mask" in batch:
            response_mask = batch["attention_mask"][:, -resp_len:]
        elif "response_mask" in batch:
            response_mask = batch["response_mask"]
        else:
            raise KeyError("batch needs an 'attention_mask' (or 'response_mask') tensor to find valid response tokens")
        valid_resp_len = response_mask.to(torch.long).sum(dim=-1).tolist()

        if self.reward_fn_key not in batch:
            raise KeyError(
                f"batch has no non-tensor {self.reward_fn_key!r} (data.reward_fn_key); "
                f"available keys: {batch.keys()}"
            )
        data_sources = batch[self.reward_fn_key]
        if "reward_model" not in batch:
            raise KeyError(
                "batch has no non-tensor 'reward_model' (dict with 'ground_truth'); "
                f"available keys: {batch.keys()}"
            )
        reward_models = batch["reward_model"]
        extra_infos = batch["extra_info"] if "extra_info" in batch else None

        prompts = batch["prompts"] if "prompts" in batch else None
        prompt_valid: list[int] | None = None
        if self.num_examine > 0 and prompts is not None:
            if "attention_mask" in batch:
                prompt_valid = batch["attention_mask"][:, : prompts.shape[1]].to(torch.long).sum(-1).tolist()
            else:
                prompt_valid = [prompts.shape[1]] * bsz

        reward = torch.zeros(bsz, resp_len, dtype=torch.float32, device=responses.device)
        step_mask = None
        extra: dict[str, list] = {"score": []}
        extra_keys_seen: list[str] = []
        per_sample_extras: list[dict] = []
        failed: list[bool] = []
        self.failures = 0

        samples = []
        for i in range(bsz):
            ids = responses[i, :int(valid_resp_len[i])].tolist()
            rm = _as_python(reward_models[i])
            if not isinstance(rm, dict) or "ground_truth" not in rm:
                raise ValueError(
                    f"sample {i}: reward_model must be a dict with a 'ground_truth' entry, got {rm!r}"
                )
            extra_info = _as_python(extra_infos[i]) if extra_infos is not None else None
            if self.extra_info_fields:
                extra_info = {**(extra_info or {}), **self.extra_info_fields}
            samples.append((ids, self.tokenizer.decode(ids, skip_special_tokens=True), _as_python(data_sources[i]),
                            _as_python(rm["ground_truth"]), extra_info))
        batch_scores = self._batch_source_scores(batch, [s[1] for s in samples], [s[3] for s in samples])
        step_source = next((source for source in self.sources or [] if source.step_keys), None)

        if self._processes is not None:
            together = self._call_in_processes(samples)
        elif self.batched:
            together = self._call_batch(samples)
        elif self.manager is not None or self.sources is None and inspect.iscoroutinefunction(self.compute_score):
            together = self._call_all(samples, batch)
        else:
            together = None
        for i, (ids, solution_str, data_source, ground_truth, extra_info) in enumerate(samples):
            n_valid = len(ids)
            if together is not None:
                result = together[i]
            elif self.sources is None:
                result = self._call(i, data_source, solution_str, ground_truth, extra_info)
            else:
                result = self._mixture_result(i, data_source, solution_str, ground_truth, extra_info, batch_scores)
            failed.append(result is _FAILED)
            if result is _FAILED:  # failed, on_error="zero": the row stays all zero
                score, extras = 0.0, {}
            else:
                score, extras = self._to_score(i, data_source, result)

            if result is _FAILED:
                pass
            elif step_source is not None:  # a process reward model's step rewards, on the policy's tokens
                if step_mask is None:
                    step_mask = torch.zeros(bsz, resp_len, dtype=torch.bool, device=responses.device)
                step_scores, step_ends = (batch[key][i] for key in step_source.step_keys)
                reward[i] = step_source.weight * step_scores.to(reward)
                step_mask[i] = step_ends.to(step_mask)
            elif isinstance(result, dict) and "step_rewards" in result:
                if step_mask is None:
                    step_mask = torch.zeros(bsz, resp_len, dtype=torch.bool, device=responses.device)
                for token, step_reward in self._step_positions(i, ids, solution_str, result):
                    reward[i, token] += step_reward
                    step_mask[i, token] = True
                extras = {k: v for k, v in extras.items() if k not in ("step_rewards", "step_ends")}
            else:
                reward[i, max(n_valid - 1, 0)] = score
            extra["score"].append(score)
            per_sample_extras.append(extras)
            for k in extras:
                if k not in extra_keys_seen:
                    extra_keys_seen.append(k)

            if i < self.num_examine:
                prompt_str = None
                if prompts is not None and prompt_valid is not None:
                    p_ids = prompts[i, prompts.shape[1] - prompt_valid[i]:].tolist()
                    prompt_str = self.tokenizer.decode(p_ids, skip_special_tokens=True)
                print(f"[reward {i}] data_source: {data_source}")
                print(f"[prompt] {prompt_str}")
                print(f"[response] {solution_str}")
                print(f"[ground_truth] {ground_truth}")
                print(f"[score] {score}" + (f" {extras}" if extras else "")
                      + (" (the reward function failed)" if result is _FAILED else ""))

        for k in extra_keys_seen:
            if k == "score":
                continue
            extra[k] = [e.get(k) for e in per_sample_extras]
        if self.on_error == "zero":
            extra["reward_failed"] = failed
        if step_mask is not None:
            extra["step_mask"] = step_mask
        return reward, extra


async def _await(awaitable, timeout: float | None = None):
    if timeout is None:
        return await awaitable
    return await asyncio.wait_for(awaitable, timeout)
