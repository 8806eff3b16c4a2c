"""``pretune peft merge | info``: fold an adapter into its base, or describe an adapter folder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import catalog


def cmd_merge(args) -> int:
    from ..io.checkpoint import save
    from ..io.outputs import check_folder
    from ..loading import TASK_FILE, folder_kind, load_pretrained
    from ..peft.inject import PeftError

    check_folder(args.out, overwrite=args.overwrite)
    if folder_kind(args.adapter) != "adapter":
        raise PeftError(f"{args.adapter} is not an adapter folder (no adapter_model.safetensors with "
                        "pretune_adapter.json or adapter_config.json); `peft merge` folds an adapter into its base")
    loaded = load_pretrained(args.adapter, base=args.base, merge=True)
    plain, tok = loaded.model, loaded.tokenizer
    save(plain, args.out, tokenizer=tok)
    task = Path(args.adapter) / TASK_FILE
    if task.is_file():
        from ..io.outputs import mark

        (Path(args.out) / TASK_FILE).write_text(task.read_text())
        mark(args.out, [TASK_FILE])
    print(f"merged {args.adapter} into its base -> {args.out} (a plain checkpoint: evaluate, predict, convert "
          "--to-hf work on it)")
    return 0


def cmd_info(args) -> int:
    from ..peft.files import META_FILE, PEFT_CONFIG_FILE, WEIGHTS_FILE, read_meta

    path = Path(args.adapter)
    meta = read_meta(path)
    size = (path / WEIGHTS_FILE).stat().st_size if (path / WEIGHTS_FILE).is_file() else 0
    if meta is None and (path / PEFT_CONFIG_FILE).is_file():
        cfg = json.loads((path / PEFT_CONFIG_FILE).read_text())
        print(f"{path}: a peft {cfg.get('peft_type')} adapter (r={cfg.get('r')}, alpha={cfg.get('lora_alpha')}, "
              f"targets {cfg.get('target_modules')}), {size / 1e6:.2f} MB")
        return 0
    if meta is None:
        from ..peft.inject import PeftError

        raise PeftError(f"{path}: no {META_FILE} or {PEFT_CONFIG_FILE} (not an adapter folder)")
    p = meta["peft"]
    print(f"{path}: adapter {meta['name']!r}, method {p['method']}, layout {meta['layout']}, {size / 1e6:.2f} MB")
    if meta.get("layout_why"):  # pretune's layout: why not peft's (recorded since the reason was; older ones: none)
        print(f"  layout: pretune's, not peft's ({meta['layout_why']}); peft.PeftModel cannot load it, pretune can")
    print(f"  base: {meta['base'].get('model') or '(not recorded)'} ({meta['base'].get('arch')}, dim "
          f"{meta['base'].get('dim')}, {meta['base'].get('n_layers')} layers)")
    if meta.get("head"):
        h = meta["head"]
        print(f"  head: {h['head']}" + (f", labels {h['labels']}" if h.get("labels") else ""))
    print("  settings: " + json.dumps(p))
    return 0


def add_peft_parser(sub) -> None:
    methods = catalog.listing(catalog.PEFT_METHODS)
    s = sub.add_parser("peft", help="adapter folders: merge into the base model, describe",
                       description="Parameter-efficient finetuning runs with `pretune finetune --peft METHOD`; "
                       "these commands handle the adapter folders it writes.",
                       epilog=f"methods (combine with '+', e.g. lora+prompt):\n{methods}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    psub = s.add_subparsers(dest="peft_command", required=True)
    m = psub.add_parser("merge", help="write the base model with a LoRA/(IA)3 adapter folded in (a plain checkpoint)")
    m.add_argument("adapter", help="adapter folder (pretune or peft layout)")
    m.add_argument("--out", required=True, help="folder for the merged checkpoint (new or empty)")
    m.add_argument("--overwrite", action="store_true", help="write into a non-empty --out: pretune's earlier output "
                   "there is replaced, anything else stays untouched")
    m.add_argument("--base", help="base model folder (default: the one the adapter recorded)")
    m.set_defaults(func=cmd_merge)
    i = psub.add_parser("info", help="method, settings, head, base and size of an adapter folder")
    i.add_argument("adapter", help="adapter folder")
    i.set_defaults(func=cmd_info)
