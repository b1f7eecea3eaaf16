"""One BOS/EOS rule for a run: what training puts around a document, what evaluation prepends to a request
and what the exported tokenizer adds to a text.

A tokenizer's own rule comes from its files, as ``transformers`` reads them: ``tokenizer_config.json``'s
``add_bos_token`` / ``add_eos_token`` when it sets either (the other is then false), else what
``tokenizer.json``'s post-processor adds around a text (``TemplateProcessing`` such as ``<s> $A </s>``, or
none). SentencePiece and tiktoken tokenizers are exported as Llama 2 / Llama 3 do: BOS before a text.

Training packs documents with ONE separator (``data.separator``): BOS before every document or EOS after it.
Unset, the separator follows the tokenizer's rule: BOS when it adds BOS, EOS when it adds only EOS; a
tokenizer that adds nothing gets BOS if it has one, else its end-of-text token (GPT-2's ``<|endoftext|>``).

The exported tokenizer then adds exactly what training put before a document: BOS with the bos separator,
nothing with the eos one. It never appends EOS: in training EOS only separates documents, and a text that
ends in EOS breaks lm-eval's context/continuation split and stops generation at once. When the tokenizer's
own rule differs, the export rewrites the post-processor and ``add_bos_token`` / ``add_eos_token`` and says
so in one log line; evaluation of a checkpoint (``trainer eval``, ``[eval]``) follows the same rule.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenizer._common import read_json_object

logger = logging.getLogger("trainer")

_PROBE = "The end."


@dataclass(frozen=True)
class TokenizerRule:
    """What a tokenizer's files add around a text by default."""

    adds_bos: bool
    adds_eos: bool
    source: str  # where the rule was read

    def describe(self, bos: str | None, eos: str | None) -> str:
        parts = [bos or "BOS"] * self.adds_bos + ["..."] + [eos or "EOS"] * self.adds_eos
        return " ".join(parts) if (self.adds_bos or self.adds_eos) else "nothing"


@dataclass(frozen=True)
class Separator:
    """The training separator and the rule the export and evaluation follow from it."""

    name: str  # "bos" or "eos"
    token_id: int
    note: str | None  # a line to log when the choice is not the obvious one

    @property
    def add_bos(self) -> bool:
        """Whether a text gets BOS in front (exported tokenizer, evaluation requests)."""
        return self.name == "bos"


def files_rule(folder: str | Path) -> TokenizerRule | None:
    """The rule of a Hugging Face tokenizer folder (tokenizer.json and/or tokenizer_config.json), as
    ``transformers`` applies it; None when the folder has neither."""
    folder = Path(folder)
    cfg = read_json_object(folder / "tokenizer_config.json")
    if "add_bos_token" in cfg or "add_eos_token" in cfg:
        return TokenizerRule(bool(cfg.get("add_bos_token", False)), bool(cfg.get("add_eos_token", False)),
                             "tokenizer_config.json add_bos_token/add_eos_token")
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        plain = tok.encode(_PROBE, add_special_tokens=False).ids
        full = tok.encode(_PROBE, add_special_tokens=True).ids
        # Where the text's own tokens sit inside the post-processed ones: before them BOS, after them EOS.
        start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
        return TokenizerRule(start > 0, len(full) - start > len(plain), "tokenizer.json post-processor")
    if cfg:
        return TokenizerRule(False, False, "tokenizer_config.json (no add_bos_token)")
    return None


def tokenizer_rule(tokenizer) -> TokenizerRule:
    """The rule of a loaded tokenizer (``tokenizer.build_tokenizer``)."""
    kind = type(tokenizer).__name__
    if kind == "SentencePieceTokenizer":  # exported as a Llama 2 LlamaTokenizer: add_bos_token
        return TokenizerRule(tokenizer.bos_id is not None, False, "SentencePiece (Llama 2 convention)")
    if kind == "TiktokenTokenizer":  # exported as Llama 3's tokenizer.json: BOS post-processor
        return TokenizerRule(tokenizer.bos_id is not None, False, "tiktoken (Llama 3 convention)")
    path = getattr(tokenizer, "path", None)
    rule = files_rule(Path(path).parent) if path is not None and Path(path).suffix == ".json" else None
    return rule or TokenizerRule(False, False, "no tokenizer files")


def token_string(tokenizer, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    for attr in ("_tok", "_sp"):
        impl = getattr(tokenizer, attr, None)
        if impl is not None:
            fn = getattr(impl, "id_to_token", None) or getattr(impl, "id_to_piece", None)
            return fn(token_id)
    return None


def choose_separator(tokenizer, requested: str) -> Separator:
    """The training separator: ``requested`` ("bos"/"eos"), or for "auto" the one the tokenizer's rule implies.
    Raises ValueError (naming data.separator) when the tokenizer lacks the token."""
    bos_id, eos_id = tokenizer.bos_id, tokenizer.eos_id
    rule = tokenizer_rule(tokenizer)
    note = None
    name = "bos" if requested == "auto" else requested
    if requested == "auto":
        if rule.adds_eos and not rule.adds_bos and eos_id is not None:
            name = "eos"
            note = "the tokenizer adds EOS after a text: documents are separated by EOS (data.separator = eos)"
        elif rule.adds_bos and bos_id is not None:
            name = "bos"
        elif bos_id is None and eos_id is not None:
            name = "eos"
            note = "the tokenizer has no BOS token: documents are separated by EOS (data.separator = eos)"
    token_id = bos_id if name == "bos" else eos_id
    if token_id is None:
        other = "eos" if name == "bos" else "bos"
        raise ValueError(f"data.separator: the tokenizer has no {name.upper()} token; choose {other!r}")
    sep = Separator(name, int(token_id), note)
    if rule.adds_bos != sep.add_bos or rule.adds_eos:
        bos, eos = token_string(tokenizer, bos_id), token_string(tokenizer, eos_id)
        want = TokenizerRule(sep.add_bos, False, "")
        mismatch = (f"the tokenizer's {rule.source} adds {rule.describe(bos, eos)} around a text; training puts "
                    f"one {name.upper()} {'before' if name == 'bos' else 'after'} every document, so evaluation "
                    f"and exports add {want.describe(bos, eos)}")
        sep = Separator(name, int(token_id), f"{note}; {mismatch}" if note else mismatch)
    return sep


def _post_processor(add_bos: bool, bos: str | None, bos_id: int | None, original: dict | None) -> dict | None:
    """tokenizer.json's post-processor for the rule: ByteLevel parts of the original kept, the special-token
    template replaced by ``BOS $A`` (or removed)."""
    from tokenizers import processors

    template = None
    if add_bos:
        template = json.loads(processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]).__getstate__())
    parts = original.get("processors", []) if original and original.get("type") == "Sequence" else [original]
    kept = [p for p in parts if p and p.get("type") == "ByteLevel"]
    out = kept + ([template] if template else [])
    if not out:
        return None
    return out[0] if len(out) == 1 else {"type": "Sequence", "processors": out}


def align_exported_tokenizer(folder: str | Path, tokenizer, separator: Separator) -> bool:
    """Make the tokenizer files in ``folder`` add what training put before a document (BOS or nothing, never
    EOS). Returns whether a file changed; logs one line when it did."""
    folder = Path(folder)
    before = files_rule(folder)
    if before is None:
        return False
    add_bos = separator.add_bos
    bos = token_string(tokenizer, tokenizer.bos_id)
    if add_bos and bos is None:  # a tokenizer without token strings (should not happen for BOS separators)
        add_bos = False
    cfg_path = folder / "tokenizer_config.json"
    cfg = read_json_object(cfg_path)
    cfg["add_bos_token"], cfg["add_eos_token"] = add_bos, False
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tj_path = folder / "tokenizer.json"
    if tj_path.is_file():
        data = json.loads(tj_path.read_text(encoding="utf-8"))
        data["post_processor"] = _post_processor(add_bos, bos, tokenizer.bos_id, data.get("post_processor"))
        tj_path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        if add_bos or before.adds_bos or before.adds_eos:
            from tokenizers import Tokenizer

            check = Tokenizer.from_file(str(tj_path))
            plain = check.encode(_PROBE, add_special_tokens=False).ids
            assert check.encode(_PROBE, add_special_tokens=True).ids == [tokenizer.bos_id] * add_bos + plain
    changed = (before.adds_bos, before.adds_eos) != (add_bos, False)
    if changed:
        eos = token_string(tokenizer, tokenizer.eos_id)
        logger.info("exported tokenizer: its %s added %s around a text, training put one %s %s every document: "
                    "the export adds %s (tokenizer.json post-processor, tokenizer_config.json add_bos_token=%s "
                    "add_eos_token=false)", before.source, before.describe(bos, eos), separator.name.upper(),
                    "before" if separator.name == "bos" else "after",
                    TokenizerRule(add_bos, False, "").describe(bos, eos), str(add_bos).lower())
    return changed


def run_separator(config, tokenizer, *, trained: bool = False) -> Separator:
    """The separator a run's config trains with (``data.separator``; auto: the tokenizer's). ``trained``: the
    config of a finished run (export, evaluation), whose config.toml may say bos for a tokenizer without BOS
    (runs before ``auto`` existed trained with EOS then)."""
    try:
        return choose_separator(tokenizer, config.data.separator)
    except ValueError:
        if not trained:
            raise
        sep = choose_separator(tokenizer, "auto")
        logger.info("data.separator = %s, but the tokenizer has no such token: the run trained with %s",
                    config.data.separator, sep.name)
        return sep


def align_export(folder: str | Path, config, tokenizer) -> bool:
    """The export's hook: align the tokenizer files written to ``folder`` with the run's training rule."""
    if tokenizer is None or config is None:
        return False
    return align_exported_tokenizer(folder, tokenizer, run_separator(config, tokenizer, trained=True))


def special_strings(tokenizer) -> list[str]:
    """The special-token strings of a tokenizer (BOS/EOS/pad and the other tokens its files mark special)."""
    out: list[str] = []
    impl = getattr(tokenizer, "_tok", None)
    if impl is not None and hasattr(impl, "get_added_tokens_decoder"):
        out += [t.content for t in impl.get_added_tokens_decoder().values() if t.special]
    for tid in (tokenizer.bos_id, tokenizer.eos_id, getattr(tokenizer, "pad_id", None)):
        s = token_string(tokenizer, tid)
        if s and s not in out:
            out.append(s)
    special = getattr(tokenizer, "special_tokens", None)
    if isinstance(special, dict):
        out += [s for s in special if s not in out]
    return [s for s in out if s]
