"""The run's inputs: the task's data, the model (tiny: built on the spot), the rendered prompts and the
warm start's draws; built in a child process that exits before the actors start.

Invariants:
- `input_paths` (no model code) gives the model path and the data directory before anything is built:
  the RunContext and Redis need them, not the model.
- `build_in_child` runs prepare_model_and_data, load_prompts and (when the run warm-starts)
  launch.warm_start.draw in one spawned child process, whose log lines go to the launcher's log and
  console as if the launcher wrote them. The launcher therefore never imports transformers or torch:
  they were ~220 MB of its RSS for the whole run (docs/perf/peers.md); tests/e2e/test_tiny_e2e.py checks
  the launcher's `run finished` line says so (`launcher_torch`). A tiny run whose model/ is already built (from an
  export, or resumed) reuses it and renders its prompts with `tokenizers` alone: that child imports neither.
- A failure in the child is raised in the parent as the same exception (ConfigError, BirdDataError: one
  line; anything unpicklable as a RuntimeError with its one line); a child that dies without an answer is
  a RuntimeError naming its exit code. The wait is bounded (INPUTS_TIMEOUT_S), and the child is ended
  when the parent stops waiting for any reason (Ctrl-C and SIGTERM included).
"""
from __future__ import annotations

import os
from pathlib import Path

from config import ConfigError, RunConfig, layout

# Building the inputs (the tiny model and its tokenizer, or a large model's tokenizer and every prompt)
# takes seconds to a few minutes; past this the launcher gives up with one line.
INPUTS_TIMEOUT_S = 1800.0


class Inputs:
    """What the child hands back: the model path, the data directory, the prompts and the warm start's
    draws (None: no warm start)."""

    def __init__(self, model_path: str, bird_dir: str, train_items: list, eval_items: list, draws=None):
        self.model_path, self.bird_dir = model_path, bird_dir
        self.train_items, self.eval_items, self.draws = train_items, eval_items, draws


def input_paths(cfg: RunConfig, run_dir: Path) -> tuple[str, str]:
    """(model_path, bird_dir) as prepare_model_and_data makes them, without building anything."""
    bird_dir = str(layout.data_dir(run_dir)) if cfg.data.synthetic else cfg.data.bird_dir
    if cfg.model.source == "tiny":
        return str(layout.model_dir(run_dir)), bird_dir
    return cfg.model.path, bird_dir


def offline_unless_allowed(cfg: RunConfig) -> None:
    """A hub id with model.allow_download=false loads only from the local cache (HF_HUB_OFFLINE=1): set in
    the launcher's environment, so the inputs' child and every actor inherit it."""
    if cfg.model.source != "tiny" and not cfg.model.allow_download and not Path(cfg.model.path).exists():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")


def prepare_model_and_data(cfg: RunConfig, run_dir: Path, log) -> tuple[str, str]:
    """Returns (model_path, bird_dir); builds the synthetic task and the tiny model when asked."""
    bird_dir = cfg.data.bird_dir
    if cfg.data.synthetic:
        from tasks.synthetic import write_dataset

        bird_dir = str(layout.data_dir(run_dir))
        if not (Path(bird_dir) / "train.json").exists():
            log.info("building synthetic task", dir=bird_dir, databases=cfg.data.synthetic_databases,
                     questions=cfg.data.synthetic_questions)
            write_dataset(bird_dir, cfg.data.synthetic_databases, cfg.data.synthetic_questions, cfg.data.synthetic_seed,
                          dev_fraction=cfg.data.synthetic_dev_fraction, templates=cfg.data.synthetic_templates or None,
                          held_out_databases=cfg.data.synthetic_held_out_databases,
                          value_forms=cfg.data.synthetic_value_forms, domains=cfg.data.synthetic_domains,
                          value_pool=cfg.data.synthetic_value_pool)
    model_path = cfg.model.path
    if cfg.model.source == "tiny":
        from tasks.synthetic import texts_for_tokenizer
        from tasks.tiny_model import build_tiny, built

        model_path = str(layout.model_dir(run_dir))
        if built(model_path):  # a run from an export or a resumed run: reused, nothing imported
            log.info("reusing tiny tokenizer and model", dir=model_path)
            return model_path, bird_dir
        log.info("building tiny tokenizer and model", dir=model_path)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the console keeps to our lines (and `error: ...`)
        build_tiny(model_path, texts_for_tokenizer(bird_dir), seed=cfg.seed, model_cfg=cfg.model)
    else:
        offline_unless_allowed(cfg)
    return model_path, bird_dir


def prompt_tokenizer(cfg: RunConfig, model_path: str):
    """The tokenizer prompts are rendered with. tiny's compact prompts skip the chat template, and its tokenizer
    is our own byte-level BPE with no special tokens added (tasks.tiny_model.build_tokenizer), so
    `tokenizers.Tokenizer` encodes them to the same ids as transformers' tokenizer over the same file
    (tests/integration/test_inputs.py) without importing transformers and torch (~3 CPU-s on the path to
    the first step). Every other model: transformers' AutoTokenizer."""
    tok_file = Path(cfg.model.tokenizer or model_path) / "tokenizer.json"
    if cfg.model.source == "tiny" and tok_file.exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tok_file))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_path, trust_remote_code=cfg.model.trust_remote_code)
    except OSError as e:
        raise ConfigError(f"config key 'model.path': cannot load a tokenizer from {model_path!r} "
                          f"({str(e).splitlines()[0]})") from None


def load_prompts(cfg: RunConfig, model_path: str, bird_dir: str, log) -> tuple[list, list]:
    from tasks.bird import build_prompts, load_split

    tokenizer = prompt_tokenizer(cfg, model_path)
    style = "compact" if cfg.model.source == "tiny" else "omnisql"
    out = []
    for split, limit in ((cfg.data.train_split, cfg.data.limit), (cfg.data.eval_split, cfg.data.eval_size)):
        questions = load_split(bird_dir, split)
        if limit:
            questions = questions[:limit]
        items, dropped = build_prompts(questions, tokenizer, cfg.data.max_prompt_tokens, style=style,
                                       sample_values=cfg.data.sample_values, max_turns=cfg.generator.max_turns)
        log.info("prompts", split=split, kept=len(items), dropped_over_budget=dropped)
        out.append(items)
    if not out[0]:
        raise ConfigError(f"config key 'data.max_prompt_tokens': every {cfg.data.train_split} prompt is over "
                          f"{cfg.data.max_prompt_tokens} tokens")
    return out[0], out[1]


def build(cfg: RunConfig, run_dir: Path, log) -> Inputs:
    """The inputs, built in this process (the child's work; also what a caller without a child uses)."""
    from launch.warm_start import draw, will_warm_start

    model_path, bird_dir = prepare_model_and_data(cfg, run_dir, log)
    train, held = load_prompts(cfg, model_path, bird_dir, log)
    draws = draw(cfg, train, model_path) if will_warm_start(cfg) else None
    return Inputs(model_path, bird_dir, train, held, draws)


def _child(conn, cfg: RunConfig, run_dir: str) -> None:
    """The spawned child: builds the inputs and sends ("ok", Inputs) or ("error", exception) once."""
    import pickle

    from observe.logs import setup_logging

    try:
        log = setup_logging(Path(run_dir), "launcher", level=cfg.logging.level, console=cfg.logging.console)
        answer = ("ok", build(cfg, Path(run_dir), log))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the launcher as one answer
        answer = ("error", e)
    try:
        conn.send(answer)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        from queues.errors import one_line

        conn.send(("error", RuntimeError(one_line(answer[1]) if answer[0] == "error" else f"inputs: {one_line(e)}")))
    finally:
        conn.close()


class PendingInputs:
    """The child building the inputs (module docstring): `result()` waits for them (bounded) and ends the
    child; `close()` ends it whatever its state."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(child_conn, cfg, str(run_dir)), name="arl-inputs")
        self._proc.start()
        child_conn.close()  # the parent's copy: EOF once the child is gone

    def result(self, timeout_s: float = INPUTS_TIMEOUT_S) -> Inputs:
        try:
            if not self._conn.poll(timeout_s):
                raise ConfigError(f"the run's inputs (model, data, prompts) were not ready within {timeout_s:g} s")
            try:
                kind, value = self._conn.recv()
            except EOFError:
                self._proc.join(5.0)
                raise RuntimeError(f"the process building the run's inputs died (exit code {self._proc.exitcode})") from None
            if kind == "error":
                raise value
            self.close(grace_s=5.0)  # it has answered: it exits on its own
            return value
        finally:
            self.close()

    def close(self, grace_s: float = 0.0) -> None:
        """Ends the child: after `grace_s` for it to exit on its own, killed."""
        if self._proc is None:
            return
        self._proc.join(grace_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self._conn.close()
        self._proc = None


def build_in_child(cfg: RunConfig, run_dir: Path) -> PendingInputs:
    """Starts building the run's inputs in a child process (module docstring)."""
    return PendingInputs(cfg, run_dir)
