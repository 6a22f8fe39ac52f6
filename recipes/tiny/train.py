"""Train the embedded default model: a ~4.2 M-parameter Qwen3-MoE that calls the four tools of
`world.py`, the user's own tools (`generic.py`: random tool schemas and requests) and writes the
small functions of `coding.py`.

    python -m freetoken_agents.recipes.tiny.train --out build/tiny            # from scratch
    python -m freetoken_agents.recipes.tiny.train --out build/tiny-generic \
        --init freetoken_agents/data/freetoken-tiny.ftw --steps 420 --dialogues 16000 --lr 1.5e-3 --threads 1
    python -m freetoken_agents.recipes.tiny.train --out build/distilled \
        --init freetoken_agents/data/freetoken-tiny.ftw --teacher freetoken_agents/data/freetoken-tiny.ftw \
        --distill 5 --steps 2000 --lr 5e-4 --code-share 0.55   # its coding and world turns distilled
    python -m freetoken_agents.recipes.tiny.train --out /tmp/t --steps 20     # a smoke run
    python -m freetoken_agents.recipes.tiny.train --out build/tiny --device cuda  # on a GPU (bf16 autocast)

The shipped freetoken-tiny.ftw is the model trained by this module at commit 8526d06 (the four
tools and coding only, ~26 min on 2 cores), continued for 200 steps on the world's tools (place
names that may start with a vowel: the first model wrote "Fassaka" for Osaka) and coding (14 min;
the model of commit c0b0256), then continued on the generic tool-use corpus (issue 34): 420 steps,
1,500 more with a third more no-call exchanges, and 400, 300 and 250 more with growing coding
shares (coding first tries had fallen to 66%); about 50 min of training on 2 cores in all:

    git show 1420e20:freetoken_agents/data/freetoken-tiny.ftw > build/first.ftw  # that model
    python -m freetoken_agents.recipes.tiny.train --out build/tiny-vowels \
        --init build/first.ftw --steps 200 --dialogues 6000 --lr 5e-4 --threads 2 \
        --code-share 0.45 --world-share 0.55
    git show c0b0256:freetoken_agents/data/freetoken-tiny.ftw > build/vowels.ftw  # the model it gave
    T="python -m freetoken_agents.recipes.tiny.train"
    $T --out build/g34a --init build/vowels.ftw --steps 420 --dialogues 16000 --lr 1.5e-3 --threads 2
    $T --out build/g34b --init build/g34a/model.ftw --steps 1500 --dialogues 30000 --lr 1e-3 \
        --no-call-share 0.4 --threads 2
    $T --out build/g34c --init build/g34b/model.ftw --steps 400 --dialogues 12000 --lr 7e-4 \
        --code-share 0.5 --world-share 0.2 --no-call-share 0.4 --threads 2
    $T --out build/g34d --init build/g34c/model.ftw --steps 300 --dialogues 9000 --lr 5e-4 \
        --code-share 0.6 --world-share 0.15 --no-call-share 0.4 --threads 1
    $T --out build/g34e --init build/g34d/model.ftw --steps 250 --dialogues 8000 --lr 3e-4 \
        --code-share 0.7 --world-share 0.15 --no-call-share 0.4 --threads 2   # the shipped model

A curriculum (copying values first, measured and not shipped: see the README) is the same chain
with the first generic phase's first 140 steps on plain, always-calling requests:

    $T --out build/cB --init build/vowels.ftw --steps 420 --dialogues 16000 --lr 1.5e-3 \
        --threads 1 --copy-first 140        # then the four commands above from build/cB/model.ftw

The FTW file names the four tools it was trained to call (metadata "trained_tools"): relevant calls
(`freetoken_agents/relevance.py`) leave the decision on them to the model.

`--init` continues from an FTW file with its tokenizer (see `warm.py`). On 2 shared cores a step
of 4,096 conversation tokens takes ~1 s with 2 threads (~1.5 s with one).

Reproducible: the corpus, the tokenizer, the initialisation and the batch order all follow `--seed`
(bit-identical reruns need the same torch build and thread count). The text is rendered by the
engine's own `render_chat`; the tokenizer is a byte-level BPE trained with `tokenizers` on that
text; the trained model is saved as a Hugging Face checkpoint and converted to FTW by the engine's
converter (the same Qwen3-MoE adapter the engine loads it with). Loss is on the conversation after
the system block (see `examples.render`).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from freetoken_agents.engine import DEFAULT_CHAT_TEMPLATE, EngineError, FTWFormatError, check_device
from freetoken_agents.engine.ftw.reader import FTWFile

from . import generic
from .corpus import TOOL_SCHEMAS, Dialogue, build_corpus
from .examples import Example, batches, encode_all, render, short_enough, split_system_block, steps_of
from .forward import distillation_loss, distilled_blocks, shared_block_forward
from .resume import load_progress, save_progress
from .tokenizer import character_tokenizer, train_tokenizer
from .warm import load_ftw

logger = logging.getLogger(__name__)


def model_config(vocab_size: int, eos_id: int, pad_id: int) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=192,
        intermediate_size=384,
        moe_intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        router_aux_loss_coef=0.01,
        output_router_logits=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )


def train(
    out: Path,
    *,
    steps: int = 3000,
    seed: int = 0,
    vocab_size: int = 2048,
    dialogues: int = 100_000,
    tokens_per_batch: int = 4096,
    lr: float = 3e-3,
    threads: int | None = None,
    quant: str = "bf16",
    init: Path | None = None,
    save_every: int = 0,
    device: str = "cpu",
    code_share: float = 0.3,
    world_share: float = 0.15,
    no_call_share: float = generic.NO_CALL_SHARE,
    resume: bool = False,
    teacher: Path | None = None,
    distill: float = 1.0,
    copy_first: int = 0,
) -> Path:
    """Train and write `out/hf` (the checkpoint) and `out/model.ftw`; returns the FTW path.

    `init`: an FTW file to start from (its tokenizer and weights, see `warm.py`) instead of a new
    tokenizer and a random initialisation. `device`: where to train ("cuda": fp32 master weights,
    bf16 autocast); the corpus, the batches' order and the saved files do not depend on it.
    `code_share`, `world_share`: the corpus mix (the rest is generic tool use, see `build_corpus`);
    `no_call_share`: the share of generic exchanges answered without a call.
    `save_every`: also write `out/last` (weights, tokenizer, optimizer and position in the batch
    order) every N steps; `resume`: continue from `out/last` where a run stopped (same arguments).
    `teacher`: an FTW file (the tokenizer of the model trained) whose next-token distributions the
    coding and world dialogues are also fitted to, `distill` times their KL added to the loss (see
    `distillation_loss`); the generic dialogues learn from their labels alone.
    `copy_first`: a curriculum, copying values first: the first N steps draw from a corpus of the
    same mix whose generic exchanges all call a tool, with requests that carry nothing but the
    intent and the values (`generic.make_request(plain=True)`: no greeting, tail or thanks); the
    rest of the `steps` from the corpus above. One schedule spans both."""
    from transformers import AutoModelForCausalLM

    from freetoken_agents.engine.loading.convert import convert_checkpoint

    if threads:
        torch.set_num_threads(threads)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    corpus = build_corpus(
        rng, dialogues, code_share=code_share, world_share=world_share, no_call_share=no_call_share
    )
    first: list[Dialogue] = []
    if copy_first:  # its own generator: the main corpus is the one a run without it trains on
        first_rng = random.Random(seed + _COPY_FIRST_SEED)
        first = build_corpus(
            first_rng, dialogues, code_share=code_share, world_share=world_share, no_call_share=0.0,
            plain_generic=True,
        )  # fmt: skip
    last = out / "last"
    state = load_progress(last) if resume else None

    from transformers import PreTrainedTokenizerFast

    bootstrap = PreTrainedTokenizerFast(
        tokenizer_object=character_tokenizer(), chat_template=DEFAULT_CHAT_TEMPLATE
    )  # renders text before the real tokenizer exists (rendering does not depend on the vocabulary)
    rendered = [render(bootstrap, d) for d in tqdm(corpus + first, desc="render", leave=False)]
    if state is not None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(last)
        model = AutoModelForCausalLM.from_pretrained(
            last, experts_implementation="eager", attn_implementation="sdpa"
        )
    elif init:
        model, tokenizer = load_ftw(init, max_position_embeddings=2048)
    else:
        tokenizer = train_tokenizer([t for t, _ in rendered[: min(20_000, len(corpus))]], vocab_size)
    encoded = [split_system_block(ids, labels) for ids, labels in encode_all(tokenizer, rendered)]
    encoded, first_encoded = encoded[: len(corpus)], encoded[len(corpus) :]
    kept, first_kept = short_enough(encoded), short_enough(first_encoded)
    examples = [encoded[i] for i in kept]
    first_examples = [first_encoded[i] for i in first_kept]
    if copy_first and not first_examples:
        raise ValueError("copy_first: the copy-first corpus has no dialogue short enough to train on")
    teacher_model, distilled = None, set()
    if teacher is not None:
        teacher_model, teacher_tokenizer = load_ftw(teacher, max_position_embeddings=2048)
        if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"{teacher}: the teacher's tokenizer is not the one of the model trained")
        teacher_model.to(device).eval().requires_grad_(False)
        distilled = distilled_blocks(examples, [corpus[i].kind for i in kept])
        distilled |= distilled_blocks(first_examples, [first[i].kind for i in first_kept])
    logger.info(
        "corpus: %d dialogues, %d conversation tokens, %d distinct system blocks",
        len(examples),
        sum(len(x) for _, x, _ in examples),
        len({b for b, _, _ in examples}),
    )

    eos_id, pad_id = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    if not init and state is None:
        model = AutoModelForCausalLM.from_config(
            model_config(len(tokenizer), eos_id, pad_id),
            experts_implementation="eager",
            attn_implementation="sdpa",
        )
    logger.info("model: %.2f M parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    model.to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, steps // 30)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
    )
    model.train()
    step, t0, epoch, skip = 0, time.perf_counter(), 0, 0
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        step, epoch, skip = state["step"], state["epoch"], state["in_epoch"]
        logger.info("resumed %s at step %d (epoch %d)", last, step, epoch)
    bar = tqdm(total=steps, initial=step, desc="train")
    # The copy-first steps, then the main corpus: each phase counts its own epochs, and a resumed
    # run takes up the phase its step falls in.
    phases = [(first_examples, seed + _COPY_FIRST_SEED, min(copy_first, steps)), (examples, seed, steps)]
    for phase_examples, phase_seed, phase_end in phases:
        if step >= phase_end:
            continue
        for phase_epoch, in_epoch, micro in _phase_steps(
            phase_examples, tokens_per_batch, pad_id, phase_seed, epoch, skip
        ):
            labelled = sum(int((y != -100).sum()) for _, _, y, _ in micro)
            loss = torch.zeros((), device=device)
            for batch in micro:
                block, ids, labels, mask = (t.to(device) for t in batch)
                with autocast:
                    output = shared_block_forward(model, block, ids, mask, labels=labels)
                    part = output.loss
                    if teacher_model is not None and tuple(batch[0].tolist()) in distilled:
                        with torch.no_grad():
                            target = shared_block_forward(teacher_model, block, ids, mask).logits
                        part = part + distill * distillation_loss(output.logits, target, labels)
                weight = int((labels != -100).sum()) / labelled
                (part * weight).backward()
                loss += part.detach() * weight
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if step % 100 == 0:
                logger.info("step %d loss %.4f (%.0f s)", step, loss.item(), time.perf_counter() - t0)
            if save_every and step % save_every == 0 and step < steps:  # to resume or evaluate a run
                # At a phase's last step the place to resume is the next phase's beginning.
                place = (0, 0) if step >= phase_end else (phase_epoch, in_epoch)
                progress = {"step": step, "epoch": place[0], "in_epoch": place[1]}
                save_progress(last, model, tokenizer, opt, sched, progress)
            if step >= phase_end:
                break
        epoch, skip = 0, 0  # the next phase starts at its beginning
    bar.close()
    model.eval().to("cpu")
    hf = out / "hf"
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    ftw = out / "model.ftw"
    # The tools it was trained to call: relevant calls leave the decision on them to the model.
    trained = {"trained_tools": [tool["function"]["name"] for tool in TOOL_SCHEMAS]}
    convert_checkpoint(hf, ftw, quant=quant, progress=False, extra_metadata=trained)
    logger.info("trained %d steps in %.0f s -> %s", steps, time.perf_counter() - t0, ftw)
    return ftw


_COPY_FIRST_SEED = 1_000_003  # offsets the copy-first corpus's and batch order's seeds from the run's


def _phase_steps(
    examples: list[Example], tokens_per_batch: int, pad_id: int, seed: int, epoch: int, skip: int
):
    """Endless optimizer steps over `examples`: (epoch, step in the epoch, micro-batches), epoch e in
    the batch order of `seed + e`, from `epoch`'s step `skip` + 1 on (where a resumed run was)."""
    while True:
        order = batches(examples, tokens_per_batch, pad_id, random.Random(seed + epoch))
        for in_epoch, micro in enumerate(steps_of(order, tokens_per_batch), start=1):
            if in_epoch > skip:  # the ones before were done before the run was resumed
                yield epoch, in_epoch, micro
        epoch, skip = epoch + 1, 0


def _check_teacher(p: argparse.ArgumentParser, teacher: Path, init: Path | None, resume: bool) -> None:
    """One-line errors, before any work, for a teacher the run cannot distil from: no such file,
    not FTW, or a tokenizer other than the model's (a run from scratch trains a new one)."""
    if not teacher.is_file():
        p.error(f"--teacher: no file {teacher}")
    if init is None:
        if not resume:
            p.error("--teacher needs --init: the teacher's tokenizer must be the model's")
        return
    try:
        with FTWFile(teacher) as t, FTWFile(init) as i:
            same = t.tokenizer_files == i.tokenizer_files
    except (FTWFormatError, OSError) as e:
        p.error(f"--teacher / --init: {e}")
    if not same:
        p.error(f"--teacher {teacher} has another tokenizer than --init {init}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (hf/ and model.ftw)")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dialogues", type=int, default=100_000)
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quant", default="bf16", help="FTW expert quantization")
    p.add_argument("--init", type=Path, default=None, help="an FTW file to continue training from")
    p.add_argument("--save-every", type=int, default=0, help="save OUT/last every N steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT/last with the same arguments")
    p.add_argument(
        "--no-call-share",
        type=float,
        default=generic.NO_CALL_SHARE,
        help="share of generic exchanges answered without a call",
    )
    p.add_argument(
        "--teacher",
        type=Path,
        default=None,
        help="an FTW file the coding and world dialogues are distilled from",
    )
    p.add_argument("--distill", type=float, default=1.0, help="weight of the teacher's KL in the loss")
    p.add_argument(
        "--copy-first",
        type=int,
        default=0,
        metavar="STEPS",
        help="a curriculum: the first STEPS steps on generic requests carrying only intent and values",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (bf16 autocast on CUDA)")
    p.add_argument("--code-share", type=float, default=0.3, help="share of coding dialogues")
    p.add_argument("--world-share", type=float, default=0.15, help="share of the four world tools' dialogues")
    args = p.parse_args(argv)
    if min(args.code_share, args.world_share) < 0 or args.code_share + args.world_share > 1:
        p.error("--code-share and --world-share must be >= 0 and add up to at most 1")
    if not 0 <= args.no_call_share <= 1:
        p.error(f"--no-call-share must be between 0 and 1, got {args.no_call_share}")
    if args.teacher is not None:
        _check_teacher(p, args.teacher, args.init, args.resume)
    if not 0 <= args.copy_first <= args.steps:
        p.error(f"--copy-first must be between 0 and --steps ({args.steps}), got {args.copy_first}")
    if args.distill < 0:
        p.error(f"--distill must be >= 0, got {args.distill}")
    try:
        check_device(args.device)
    except EngineError as exc:
        p.error(f"--device: {exc}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    train(
        args.out,
        steps=args.steps,
        seed=args.seed,
        dialogues=args.dialogues,
        tokens_per_batch=args.tokens_per_batch,
        lr=args.lr,
        threads=args.threads,
        quant=args.quant,
        init=args.init,
        save_every=args.save_every,
        device=args.device,
        code_share=args.code_share,
        world_share=args.world_share,
        no_call_share=args.no_call_share,
        resume=args.resume,
        teacher=args.teacher,
        distill=args.distill,
        copy_first=args.copy_first,
    )


if __name__ == "__main__":
    main()
