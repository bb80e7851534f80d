"""``allhands prepare``, ``export`` and ``report``: data in (token shards), weights out
(safetensors, transformers directories), plots of a run (attached to its experiment trackers)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from allhands.errors import ConfigError


def _bpe_vocab(spec: str) -> int:
    kind, _, vocab = spec.partition(":")
    if kind != "bpe" or not vocab.isdigit():
        raise ConfigError(f"--train-tokenizer: {spec!r} is not allowed; use bpe:VOCAB, e.g. bpe:8192")
    return int(vocab)


def cmd_prepare(args: argparse.Namespace) -> int:
    from allhands.data.corpus import prepare_corpus, wrote
    from allhands.errors import DataError

    if args.workers < 0:
        raise ConfigError(f"--workers: {args.workers} is not allowed; must be >= 0 (0 = one per core)")
    try:
        meta = prepare_corpus(args.inputs, args.out, format=args.format, tokenizer=args.tokenizer,
                              field=args.field, eot=args.eot, val_fraction=args.val_fraction,
                              train_bpe_vocab=_bpe_vocab(args.train_tokenizer) if args.train_tokenizer else 0,
                              workers=args.workers, progress=not args.quiet and sys.stderr.isatty())
    except DataError as e:  # bad input found before any shard is written: invalid input, exit 2
        raise ConfigError(str(e)) from None
    except KeyboardInterrupt:
        print("allhands: interrupted; run the same command again to continue where it stopped",
              file=sys.stderr)
        return 130
    print(f"allhands: wrote {wrote(meta)} to {args.out} "
          f"(tokenizer {meta['tokenizer']}, vocabulary {meta['vocab_size']:,}, {meta['dtype']})")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from allhands.report import make_report
    from allhands.trackers import attach_report

    paths = make_report(Path(args.run_dir))
    for path in paths:
        print(path)
    attach_report(Path(args.run_dir), paths, os.environ)  # reopens the run's tracker runs
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from allhands.checkpoint.export import export_hf, export_weights
    from allhands.errors import DataError

    if not Path(args.run_dir).is_dir():
        raise ConfigError(f"export: {args.run_dir!r} is not a directory; pass a run directory")
    if args.format == "safetensors":
        out = export_weights(args.run_dir, args.out, step=args.step)
    else:
        try:
            out, note = export_hf(args.run_dir, args.out, args.step, args.max_shard_size)
        except DataError as e:  # the tokenizers library is missing
            raise ConfigError(str(e)) from None
        if note:
            print(f"allhands: {note}", file=sys.stderr)
    print(f"allhands: wrote {out}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("prepare", help="turn a local corpus into token shards (started again, it continues)")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, globs or directories: .txt (one document each), .jsonl[.gz|.zst], "
                        ".parquet, .arrow, or a datasets save_to_disk directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--field", "--column", dest="field", default="text",
                   help="JSON field or parquet/Arrow column holding the text (default: text)")
    p.add_argument("--tokenizer", default="byte", metavar="byte|TOKENIZER_JSON|HF_DIR",
                   help="byte (default), a Hugging Face tokenizer.json, or a transformers tokenizer "
                        "directory (tokenizer.json, tokenizer_config.json: eos/bos, chat template)")
    p.add_argument("--format", default="auto", choices=("auto", "text", "instruct"),
                   help="text documents, or instruction rows (prompt/response or chat messages, "
                        "loss on the responses only); auto: instruct when the first JSON row has "
                        "messages or prompt")
    p.add_argument("--train-tokenizer", default="", metavar="bpe:VOCAB",
                   help="train a byte-level BPE with VOCAB ids on the inputs and use it")
    p.add_argument("--eot", default="", metavar="TOKEN",
                   help="end-of-document token of --tokenizer (default: <|endoftext|>, </s>, ...)")
    p.add_argument("--workers", type=int, default=0, help="tokenizer processes (default: one per core)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="held-out share of tokens")
    p.add_argument("--quiet", action="store_true", help="no progress bar (none when stderr is no terminal)")
    p.set_defaults(fn=cmd_prepare)

    e = sub.add_parser("export", help="write a run's weights as one .safetensors file or a "
                                      "transformers directory (start a run from either "
                                      "with checkpoint.init_from)")
    e.add_argument("run_dir", help="a run directory made by `allhands train`")
    e.add_argument("--out", required=True, help="output file (its name must end in .safetensors), "
                                                "or a directory with --format hf")
    e.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors (allhands' names) or hf: config.json, the weights and "
                        "the tokenizer, for AutoModelForCausalLM.from_pretrained")
    e.add_argument("--max-shard-size", default="5GB",
                   help="with --format hf: the largest weights file (e.g. 5GB, 500MB); a larger model "
                        "is written as shards with model.safetensors.index.json")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    e.set_defaults(fn=cmd_export)

    r = sub.add_parser("report", help="draw PNG plots of a run")
    r.add_argument("run_dir", help="a run directory made by `allhands train`; plots go to RUN_DIR/report")
    r.set_defaults(fn=cmd_report)
