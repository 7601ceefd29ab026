"""Recommend: rank candidate movies for a viewer, then serve the next page from the prefix cache.

The viewer's history is the query and each candidate title an item; the score is P(" yes") within
{" yes", " no"} after the question. `rank` sorts the page and keeps the top 3. The second page
shares the query, so prefill_extend finds its K/V in the prefix cache and runs only the items.
The example names prefill_extend: "auto" prices each call alone, and for one page of short items
on a CPU it may pick a packed backend, which caches nothing for the next page.

    python examples/recommend.py [--model PATH_OR_HUB_ID]

The embedded SmolLM2-135M is a tiny model: the ranking shows the API, not a recommender's
quality. Any instruction-tuned checkpoint tpuscore loads gives better orderings.
"""

import argparse
import time

from tpuscore import Scorer

HISTORY = ["The Matrix", "Blade Runner 2049", "Interstellar", "Alien", "Dune"]
QUERY = f"A viewer's favourite movies are {', '.join(HISTORY)}: all science fiction.\n"
ITEM = "Next movie: {title}\nIs it science fiction, like the favourites?"
LABELS = [" yes", " no"]  # positive first

PAGES = [
    ["Arrival", "The Notebook", "Ex Machina", "Mamma Mia!"]
    + ["Gravity", "Love Actually", "Edge of Tomorrow", "Bridget Jones's Diary"],
    ["The Martian", "Pretty Woman", "Inception", "Notting Hill"]
    + ["Minority Report", "Sleepless in Seattle", "Ad Astra", "The Holiday"],
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    args = parser.parse_args()

    scorer = Scorer.from_pretrained(args.model, backend="prefill_extend")  # module doc
    cache = scorer.get_backend("prefill_extend").cache
    print(f"Viewer's history: {', '.join(HISTORY)}")
    for number, titles in enumerate(PAGES, 1):
        hits = cache.hits
        start = time.perf_counter()
        items = [ITEM.format(title=title) for title in titles]
        top = scorer.rank(QUERY, items, labels=LABELS, top_k=3)
        ms = (time.perf_counter() - start) * 1000
        served = "the prefix cache" if cache.hits > hits else "a fresh prefill"
        print(f"\nPage {number}: {len(titles)} candidates in {ms:.0f} ms, query from {served}")
        for rank, item in enumerate(top, 1):
            print(f"  {rank}. {titles[item.index]:<24} P(yes) = {item.score:.3f}")
    print(f"\nprefix cache: {cache.hits} hit(s), {cache.misses} miss(es), {cache.bytes} bytes held")


if __name__ == "__main__":
    main()
