"""Checkpointer: saves and loads an engine, and any Stateful objects beside it.

    ckpt = zeroshard.Checkpointer(engine, scheduler, zeroshard.RNGState(engine.device), data=loader)
    ckpt.save("ckpt/", async_save=True)       # every rank; returns at once for async saves
    client_state = ckpt.load("ckpt/")         # any world size, any stage; "ckpt/" follows `latest`

It owns what saving and loading share across calls: a gloo group of its own (only small Python
objects travel on it, and a background save on it never interleaves with training's
collectives), the background save, its snapshot buffers and the optimizer step pre-hook that
makes async saves copy-on-write (snapshot.py). It reaches the engine only through
`engine.checkpoint_state()` / `engine.restore()` (zeroshard/engine/contract.py); the mapping to
files is contents.py (save) and load.py. Creating one is collective: every rank, same order.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.distributed as dist

from zeroshard.agree import gather_all
from zeroshard.checkpointing.contents import engine_contents
from zeroshard.checkpointing.load import load_checkpoint, load_pretrained
from zeroshard.checkpointing.memory_tier import MemoryFolder, check_fits, node_bytes, write_memory_checkpoint
from zeroshard.checkpointing.model_config import model_config_of, peft_config_of
from zeroshard.checkpointing.recovery import recover
from zeroshard.checkpointing.repeat_save import SaveFingerprint, fingerprint, repeats
from zeroshard.checkpointing.save import SaveJob, agree_on_save, new_checkpoint_id, write_and_commit
from zeroshard.checkpointing.snapshot import BackgroundSave, Snapshot
from zeroshard.checkpointing.stateful import encode_rank_state, name_stateful, scope_of, to_json_value
from zeroshard.checkpointing.tiers import TierPolicy
from zeroshard.errors import ConfigError, EngineUsageError
from zeroshard.format import CheckpointReader
from zeroshard.format.manifest import MANIFEST_NAME, is_safe_file_name
from zeroshard.peers import host_name
from zeroshard.storage import Location

if TYPE_CHECKING:
    from zeroshard.engine import ZeroEngine


class Checkpointer:
    """Checkpoints of one engine plus Stateful objects (LR schedulers, RNGState, a data position).

    Stateful objects are saved under a key: their keyword, their `checkpoint_key` attribute, or
    "lr_scheduler" for a torch LR scheduler (see stateful.py).
    """

    def __init__(self, engine: "ZeroEngine", *stateful: Any, timeout_s: float = 1800.0,
                 tiers: TierPolicy | None = None, **named: Any) -> None:
        self.engine = engine
        self.stateful = name_stateful(stateful, named)
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.tiers = tiers
        self.last_recovery = ""  # the log line of the last load with tiers: which tier and step, and why
        if tiers is not None:  # the memory tier (tiers.py): this node's folder, and every rank's node
            where = gather_all((host_name(), tiers.domain_name(host_name()), tiers.named_job()), self.group,
                               action="setting up the memory tier")
            self._hosts, self._domains = [str(h) for h, _, _ in where], [str(d) for _, d, _ in where]
            if len({job for _, _, job in where}) > 1:  # checked together: every rank raises alike
                raise ConfigError(f"the ranks name different jobs for the memory tier: "
                                  f"{sorted({str(job) for _, _, job in where})}")
            self.memory = MemoryFolder(tiers.root(), host_name(), tiers.job_name())
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._eager, self._lazy = Snapshot(), Snapshot()  # async-save copies, reused from save to save
        self._background: BackgroundSave | None = None
        self._changes = 0  # engine state changes seen (optimizer steps, loads): repeat_save.py
        self._last_save: SaveFingerprint | None = None
        # copy-on-write (snapshot.py): a step must not change what a background save still reads
        if engine.optimizer is not None:  # (an inference engine's state changes only by loads)
            engine.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self.before_state_change())
        _LIVE.add(self)  # joined at exit; held weakly, so a dropped Checkpointer frees its engine and group

    def save(self, path: str, tag: str | None = None, client_state: dict | None = None, *,
             keep_last: int | None = None, async_save: bool = False, storage_options: dict | None = None,
             stateful: Mapping[str, Any] | None = None, overwrite: bool = False) -> str:
        """Save to `path/tag` (tag: step-NNNNNNNN by default); rank 0 commits once every rank
        succeeded, then moves `path/latest` and prunes to `keep_last` checkpoints. Returns the
        checkpoint's URL. async_save: snapshot now, write on a background thread (the next
        save, load, wait() or exit joins it and raises its error). `stateful`: more objects,
        for this call only. A committed checkpoint of this tag is refused, or with `overwrite`
        replaced: the new files are staged beside it and swapped in at the commit, so the old
        one stays whole until then. Raises CheckpointSaveError on every rank if any rank failed."""
        path = os.fspath(path)  # any os.PathLike
        if self.engine.optimizer is None:  # the same on every rank: all refuse
            raise EngineUsageError("save_checkpoint on an engine built without an optimizer (for inference): a "
                                   "checkpoint holds training state; write its weights with engine.full_state_items() "
                                   "(zeroshard.deepspeed: save_16bit_model)")
        self.wait()
        objects, tag = self._objects_and_tag(tag, stateful)
        if keep_last is not None and keep_last < 1:
            raise ConfigError("keep_last must be at least 1")
        root = Location(path, storage_options)
        job, background, rank_state = self._prepare(root, tag, objects, client_state, keep_last, async_save)
        job.overwrite = overwrite
        now = fingerprint(root.url_of(job.tag), self._changes, job, rank_state, self.engine.module)
        if repeats(now, self._last_save, self.group, lambda: root.child(job.tag).exists(MANIFEST_NAME)):
            return now.url  # repeat_save.py: the committed checkpoint already holds all of it
        if not async_save:
            write_and_commit(job, self.group)
        else:
            self._background = background
            self._thread = threading.Thread(target=self._run_in_background,
                                            args=(write_and_commit, job, self.group), name="zeroshard-save")
            self._thread.start()
        self._last_save = now  # (an async one's failure is raised by the wait() before any repeat)
        return now.url

    def _objects_and_tag(self, tag: str | None, stateful: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
        """The Stateful objects of this save and its tag (step-NNNNNNNN by default), checked."""
        objects = {**self.stateful, **name_stateful((), stateful or {})}
        tag = tag or f"step-{self.engine.global_steps:08d}"
        if not is_safe_file_name(tag):
            raise ConfigError(f"checkpoint tag {tag!r} must be a plain folder name")
        return objects, tag

    def _prepare(self, root: Location, tag: str, objects: dict[str, Any], client_state: Any,
                 keep_last: int | None, async_save: bool) -> tuple[SaveJob, BackgroundSave | None, bytes]:
        """What every save does on the training thread: gather the contents (and, async, take the
        snapshot), then one exchange of the outcome, the checkpoint id and the rank-state sizes.
        Also returns this rank's encoded per-rank states."""
        engine = self.engine
        error = contents = background = None
        rank_state = b""
        manifest_extra: dict[str, Any] = {}
        try:  # everything that can fail locally happens before the ranks agree; storage comes later
            if engine.rank == 0:
                manifest_extra["stateful"] = {k: to_json_value(o.state_dict(), f"state of {k!r}")
                                              for k, o in objects.items() if scope_of(o) == "global"}
                client_state = to_json_value(client_state, "client_state") if client_state is not None else None
                config = model_config_of(engine.module)
                if config is not None:  # consolidate writes it as config.json by default
                    manifest_extra["model_config"] = config
                adapters = peft_config_of(engine.module)
                if adapters is not None:  # consolidate --peft writes it as adapter_config.json
                    manifest_extra["peft_config"] = adapters
            per_rank = {k: o.state_dict() for k, o in objects.items() if scope_of(o) == "rank"}
            rank_state = encode_rank_state(per_rank) if per_rank else b""
            contents = engine_contents(engine.checkpoint_state(), rank_state)
            background = BackgroundSave(contents, self._eager, self._lazy) if async_save else None
        except Exception as exc:  # every rank learns of it before anything is written
            error = exc
        # one exchange: the outcome, the checkpoint id (rank 0's) and every rank-state size
        agreed = agree_on_save(error, self.group, (new_checkpoint_id(), len(rank_state), tag))
        assert contents is not None
        contents.list_rank_states([size for _, size, _ in agreed])
        checkpoint_id, _, tag = agreed[0]  # rank 0's: a tag given per rank could differ
        job = SaveJob(root, tag, checkpoint_id, engine.rank, engine.world_size, contents,
                      background.fill if background is not None else contents.fill, manifest_extra,
                      client_state if engine.rank == 0 else None, keep_last,
                      write_behind=background is None or not background.reads_in_place)
        return job, background, rank_state

    def save_memory(self, tag: str | None = None, client_state: dict | None = None, *, durable: str | None = None,
                    storage_options: dict | None = None, stateful: Mapping[str, Any] | None = None) -> str:
        """Save to the memory tier (this node's tmpfs folder and `tiers.replicas` peer nodes) in the
        background, after the copy-on-write snapshot; with `durable`, then copy the same checkpoint
        from tmpfs to that root (committed there manifest-last). A save that would not fit is
        refused on every rank before anything is written. Returns this node's checkpoint folder."""
        tiers = self._tiers()
        self.wait()
        engine = self.engine
        objects, tag = self._objects_and_tag(tag, stateful)
        job, background, _ = self._prepare(self.memory.location, tag, objects, client_state, None, async_save=True)
        error = None
        try:
            self.memory.check_owner()  # one job per folder (memory_tier.py), before anything else
            need = node_bytes(job.contents.specs, engine.world_size, self._hosts, tiers.replicas, engine.rank,
                              self._domains)
            check_fits(self.memory, job.tag, tiers.memory_keep_last, need, tiers.memory_cap_bytes,
                       tiers.min_free_fraction)
            self.memory.claim()  # the first write: only once the save is known to fit
        except Exception as exc:
            error = exc
        agree_on_save(error, self.group, None)
        drain = None
        if durable is not None:
            drain = dataclasses.replace(job, root=Location(os.fspath(durable), storage_options),
                                        keep_last=tiers.durable_keep_last)
        self._background = background
        self._thread = threading.Thread(target=self._run_in_background, args=(self._memory_save, job, drain),
                                        name="zeroshard-save")
        self._thread.start()
        return self.memory.tag_folder(job.tag).url

    def checkpoint(self, path: str, client_state: dict | None = None, *, storage_options: dict | None = None,
                   stateful: Mapping[str, Any] | None = None) -> list[str]:
        """Call after every step: saves what `tiers` says is due at this step (memory, durable
        into `path`, both, or nothing), in the background. Returns the tiers saved to."""
        tiers = self._tiers()
        memory, durable = tiers.due(self.engine.global_steps)
        if memory:
            self.save_memory(client_state=client_state, durable=path if durable and tiers.drain else None,
                             storage_options=storage_options, stateful=stateful)
        if durable and not tiers.drain:
            self.save(path, client_state=client_state, keep_last=tiers.durable_keep_last, async_save=True,
                      storage_options=storage_options, stateful=stateful)
        return ["memory"] * memory + ["durable"] * durable

    def _memory_save(self, job: SaveJob, drain: SaveJob | None) -> None:
        tiers = self._tiers()
        manifest = write_memory_checkpoint(job, self.memory, self._hosts, tiers.replicas, tiers.memory_keep_last,
                                           self.group, self._domains)
        if drain is not None:  # the durable copy reads tmpfs, never the engine (which trains on meanwhile)
            with CheckpointReader(self.memory.tag_folder(job.tag), manifest) as reader:
                def fill(spec: Any, start: int, end: int, write: Any) -> None:
                    data = reader.read_flat(manifest.tensors[spec.name], start, end)
                    write(memoryview(data.contiguous().view(torch.uint8).numpy()))
                write_and_commit(dataclasses.replace(drain, fill=fill, write_behind=True), self.group)  # fresh tensors

    def _tiers(self) -> TierPolicy:
        if self.tiers is None:
            raise ConfigError("the memory tier needs Checkpointer(..., tiers=zeroshard.TierPolicy(...))")
        return self.tiers

    def load(self, path: str | None, *, strict: bool = True, load_optimizer_states: bool = True,
             storage_options: dict | None = None, stateful: Mapping[str, Any] | None = None,
             load_module_only: bool = False) -> Any:
        """Load a checkpoint saved at any world size and stage (a root follows `latest`) into
        the engine and the Stateful objects; returns its client_state. strict=False skips
        parameters missing on either side. Per-rank states (RNG) come back only at the same
        world size. Raises on every rank if any rank failed, before anything is restored.
        With `tiers`: the newest verified memory checkpoint (own node's copy, else a peer's),
        else the newest in `path` (recovery.py); `last_recovery` says which and why.
        load_module_only: weights and buffers only (a warm start): counters, loss scale, optimizer
        and Stateful objects stay as they are."""
        self.wait()
        objects = {**self.stateful, **name_stateful((), stateful or {})}

        def load(where: str, options: dict | None) -> Any:
            return load_checkpoint(self.engine, self.group, where, strict=strict,
                                   load_optimizer_states=load_optimizer_states, stateful=objects,
                                   storage_options=options, load_module_only=load_module_only)
        durable = None if path is None else os.fspath(path)  # any os.PathLike
        if self.tiers is None:
            if durable is None:
                raise ConfigError("load(None) needs a memory tier (Checkpointer(..., tiers=...))")
            return load(durable, storage_options)
        result, self.last_recovery, heal = recover(self.engine.rank, self.engine.world_size, self.group,
                                                   self.memory, self._hosts, self.tiers.replicas, durable,
                                                   storage_options, load, self._domains)
        if heal is not None:  # the replicas a wiped node keeps come back while training goes on
            self._thread = threading.Thread(target=self._run_in_background, args=(heal,), name="zeroshard-heal")
            self._thread.start()
        return result

    def load_pretrained(self, path: str, *, strict: bool = True, storage_options: dict | None = None,
                        strip_prefix: str | list[str] | None = None) -> None:
        """Load model weights from a full model: one .safetensors file or an HF-style folder (or
        their torch.save counterparts); strip_prefix: removed from the file's names ("module.")."""
        path = os.fspath(path)  # any os.PathLike
        self.wait()
        load_pretrained(self.engine, self.group, path, strict=strict, storage_options=storage_options,
                        strip_prefix=strip_prefix)

    def before_state_change(self) -> None:
        """Copy what a running background save has not written yet (copy-on-write): called by
        the optimizer's step pre-hook, and by the engine conveniences before restoring state.
        Call it before changing the engine's masters or optimizer state any other way."""
        self._changes += 1
        if self._background is not None:
            self._background.detach()

    def wait(self) -> None:
        """Block until a background save has finished; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._background = None
        if self._error is not None:
            error, self._error = self._error, None
            self._last_save = None  # that save committed nothing: a repeat of it is no repeat
            raise error

    def _run_in_background(self, run: Callable[..., None], *args: Any) -> None:
        try:
            run(*args)
        except BaseException as exc:  # kept for the next call: never swallowed
            self._error = exc

    def _join_at_exit(self) -> None:
        try:
            self.wait()
        except BaseException as exc:
            print(f"zeroshard: background checkpoint save failed: {exc}", file=sys.stderr)

    def __del__(self) -> None:
        # A running save's thread holds this object, so here the save has ended; an error
        # nobody collected with wait() is still reported, never dropped.
        error = getattr(self, "_error", None)  # absent when __init__ raised
        if error is not None:
            print(f"zeroshard: background checkpoint save failed: {error}", file=sys.stderr)


_LIVE: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


@atexit.register
def _join_all_at_exit() -> None:
    for checkpointer in list(_LIVE):
        checkpointer._join_at_exit()
