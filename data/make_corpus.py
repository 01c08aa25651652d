"""Write data/corpus.txt: the course's own English-like text, made from a small grammar.

Run `python data/make_corpus.py` to regenerate (byte-identical every time, on any platform), or
`python data/make_corpus.py --check` to verify the committed file.

Every word list and sentence template below was written for this course; nothing is downloaded
or copied. The text is village small talk: short stories with a recurring character, dialogue,
and simple sums ("had 3 pears and found 4 more, so now she has 7"), so that a tiny character-level
model has some structure to learn beyond spelling: names come back as pronouns, quotes close,
sums add up.

What it leaves out: real English statistics. The vocabulary is a few hundred words and the
grammar is a handful of templates, which is the point: a model with ~100k parameters can make
visible progress on it within a lab.
"""
import argparse
import hashlib
import sys
from pathlib import Path

TARGET_BYTES = 1_000_000
SEED = 20240611

# A hand-rolled generator (splitmix64) instead of Python's `random`, so the bytes cannot change
# with the Python version.
MASK64 = (1 << 64) - 1


class SplitMix64:
    def __init__(self, seed: int):
        self.state = seed & MASK64

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next_u64() % n

    def pick(self, items):
        return items[self.below(len(items))]

    def chance(self, percent: int) -> bool:
        return self.below(100) < percent


SHE, HE, THEY = ("she", "her", "her"), ("he", "him", "his"), ("they", "them", "their")
PEOPLE = [(name,) + pronouns for name, pronouns in [  # (name, subject, object, possessive)
    ("Mira", SHE), ("Tobin", HE), ("Alder", HE), ("Wren", SHE), ("Osk", THEY), ("Pell", HE),
    ("Juna", SHE), ("Brisk", THEY), ("Calla", SHE), ("Dunmore", HE), ("Essa", SHE), ("Fenn", HE),
    ("Gilda", SHE), ("Harrow", THEY), ("Ivo", HE), ("Kestrel", SHE), ("Lumo", THEY), ("Nell", SHE),
]]
ANIMALS = ["goat", "fox", "heron", "mole", "badger", "hen", "otter", "crow", "hare", "pony",
           "beetle", "owl", "toad", "lamb", "wolf", "magpie", "snail", "cat"]
ADJECTIVES = ["quiet", "muddy", "golden", "small", "old", "bright", "crooked", "sleepy", "cold",
              "warm", "green", "narrow", "broken", "tall", "round", "hungry", "clever", "dusty",
              "patient", "silver", "windy", "tired", "gentle", "loud"]
PLACES = ["mill", "bridge", "orchard", "market", "well", "forge", "meadow", "harbor", "bakery",
          "chapel", "barn", "river bank", "hill", "library", "garden", "ferry", "inn", "quarry"]
THINGS = ["apple", "pear", "lantern", "basket", "stone", "letter", "key", "loaf", "rope", "bell",
          "feather", "coin", "kettle", "map", "shell", "candle", "button", "plum", "bucket", "book"]
TIMES = ["at dawn", "in the morning", "before noon", "after lunch", "in the evening",
         "at dusk", "late at night", "on market day", "after the rain", "when the bell rang"]
WEATHER = ["the wind came down from the hill", "a thin rain was falling",
           "the sky was the color of slate", "the sun sat low over the roofs",
           "fog lay along the river", "the frost had not yet melted",
           "the swallows were flying low", "the air smelled of bread and smoke"]
GO_VERBS = ["walked", "ran", "hurried", "wandered", "climbed", "rode", "went", "strolled"]
DO_VERBS = ["found", "carried", "mended", "painted", "dropped", "counted", "hid", "washed",
            "borrowed", "polished", "traded", "lost", "wrapped", "weighed"]
FEELINGS = ["glad", "puzzled", "worried", "proud", "cross", "curious", "calm", "surprised"]
SAYINGS = [
    "A full basket is a light heart.", "Never trust a goat with a secret.",
    "The river keeps what the bridge forgets.", "Slow hands make straight rows.",
    "Count twice and carry once.", "Every bell rings for somebody.",
    "Mend the rope before the storm.", "A quiet mill grinds the finest flour.",
]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve"]


def plural(word: str, count: int) -> str:
    if count == 1:
        return word
    if word.endswith(("sh", "ch", "s", "x")):
        return word + "es"
    if word.endswith("f"):
        return word[:-1] + "ves"
    return word + "s"


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def capitalize(sentence: str) -> str:
    return sentence[0].upper() + sentence[1:]


class Storyteller:
    """One paragraph at a time; the paragraph's hero comes back as a pronoun."""

    def __init__(self, rng: SplitMix64):
        self.rng = rng

    def subject(self, hero) -> str:
        return hero[0] if self.rng.chance(45) else hero[1]

    def verb_s(self, hero, singular: str, plural_form: str) -> str:
        # "they" takes the plural verb, as in "they were".
        return plural_form if hero[1] == "they" else singular

    def sentence(self, hero) -> str:
        r, kind = self.rng, self.rng.below(9)
        if kind == 0:
            return (f"{self.subject(hero)} {r.pick(GO_VERBS)} to the {r.pick(PLACES)} "
                    f"{r.pick(TIMES)}.")
        if kind == 1:
            adj, animal = r.pick(ADJECTIVES), r.pick(ANIMALS)
            return (f"the {adj} {animal} {r.pick(DO_VERBS)} {article(r.pick(THINGS))} "
                    f"near the {r.pick(PLACES)}.")
        if kind == 2:
            return (f"{r.pick(TIMES)}, {self.subject(hero)} {r.pick(DO_VERBS)} "
                    f"the {r.pick(ADJECTIVES)} {r.pick(THINGS)}.")
        if kind == 3:
            a, b = r.below(9) + 1, r.below(9) + 1
            thing = r.pick(THINGS)
            has = self.verb_s(hero, "has", "have")
            return (f"{hero[0]} had {a} {plural(thing, a)} and {r.pick(DO_VERBS)} {b} more, "
                    f"so now {hero[1]} {has} {a + b}.")
        if kind == 4:
            a = r.below(10) + 3
            b = r.below(a - 1) + 1
            return (f"there were {NUMBER_WORDS[a]} {plural(r.pick(ANIMALS), a)} "
                    f"by the {r.pick(PLACES)}, "
                    f"and {NUMBER_WORDS[b]} went home, so {NUMBER_WORDS[a - b]} stayed.")
        if kind == 5:
            was = self.verb_s(hero, "was", "were")
            return f"{self.subject(hero)} {was} {r.pick(FEELINGS)}, because {r.pick(WEATHER)}."
        if kind == 6:
            other = r.pick(PEOPLE)[0]
            if other == hero[0]:
                return f'{hero[0]} said to nobody in particular, "{r.pick(SAYINGS)}"'
            question = f"Have you seen my {r.pick(THINGS)}?"
            return f'"{question}" asked {other}. {hero[0]} answered, "{r.pick(SAYINGS)}"'
        if kind == 7:
            return f"{r.pick(WEATHER)}, and {hero[3]} {r.pick(THINGS)} was {r.pick(ADJECTIVES)}."
        return (f"when the {r.pick(ANIMALS)} saw {hero[2]}, it {r.pick(DO_VERBS)} "
                f"{article(r.pick(THINGS))} and hid behind the {r.pick(PLACES)}!")

    def paragraph(self) -> str:
        hero = self.rng.pick(PEOPLE)
        place = self.rng.pick(PLACES)
        opening = f"{hero[0]} lived by the {place} with {article(self.rng.pick(ANIMALS))}."
        count = 3 + self.rng.below(5)
        sentences = [opening] + [capitalize(self.sentence(hero)) for _ in range(count)]
        return " ".join(sentences)


def make_corpus(target_bytes: int = TARGET_BYTES, seed: int = SEED) -> str:
    teller, parts, size, story = Storyteller(SplitMix64(seed)), [], 0, 0
    while size < target_bytes:
        if size == 0 or teller.rng.chance(4):
            story += 1
            heading = f"Story {story}\n\n"
            parts.append(heading)
            size += len(heading)
        text = teller.paragraph() + "\n\n"
        parts.append(text)
        size += len(text)
    return "".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("corpus.txt"))
    parser.add_argument("--check", action="store_true", help="verify --out instead of writing it")
    args = parser.parse_args(argv)
    data = make_corpus().encode("ascii")
    digest = hashlib.sha256(data).hexdigest()
    if args.check:
        same = args.out.exists() and args.out.read_bytes() == data
        verdict = "matches" if same else "DIFFERS from"
        print(f"{args.out}: {verdict} the generator (sha256 {digest})")
        return 0 if same else 1
    args.out.write_bytes(data)
    print(f"wrote {args.out}: {len(data)} bytes, sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
