#!/usr/bin/env python3
"""Generate MiniMind's bundled training corpus deterministically.

The corpus needs no download: it is built from templates and small word lists
(short stories, simple facts (arithmetic, colours, animals, days, months,
capitals, shapes, opposites, jobs) and chats that ask about the same facts).
Every answer in the SFT and DPO files is consistent with the pretraining
text, so a tiny model trained for a few CPU minutes gives sensible demo
replies.

Usage:
    python scripts/make_data.py                 # writes data/*.jsonl, seed 42 (sft_reasoning.jsonl too)
    python scripts/make_data.py --seed 7 --out_dir /tmp/data

The output is byte-identical for a given seed and set of size options.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# --------------------------------------------------------------------------
# Knowledge base.  Both the pretraining text and the chats draw from here so
# the facts never contradict each other.
# --------------------------------------------------------------------------

NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]

SEASON_OF_MONTH = {
    "December": "winter",
    "January": "winter",
    "February": "winter",
    "March": "spring",
    "April": "spring",
    "May": "spring",
    "June": "summer",
    "July": "summer",
    "August": "summer",
    "September": "autumn",
    "October": "autumn",
    "November": "autumn",
}

COLOURS = {
    "the sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "a banana": "yellow",
    "a strawberry": "red",
    "an orange": "orange",
    "a carrot": "orange",
    "a lemon": "yellow",
    "a frog": "green",
    "milk": "white",
    "a tomato": "red",
    "a cucumber": "green",
    "a pumpkin": "orange",
    "the sun": "yellow",
    "a crow": "black",
    "a fire truck": "red",
    "a plum": "purple",
    "an eggplant": "purple",
    "chocolate": "brown",
    "a polar bear": "white",
    "a flamingo": "pink",
    "a lime": "green",
    "a cherry": "red",
    "the sea": "blue",
    "a blueberry": "blue",
    "a lettuce leaf": "green",
    "a swan": "white",
    "a raven": "black",
    "a grape": "purple",
    "a pig": "pink",
    "tree bark": "brown",
    "a canary": "yellow",
    "a ruby": "red",
    "an emerald": "green",
    "a sapphire": "blue",
    "a penguin's belly": "white",
    "a school bus": "yellow",
    "a panda's ear": "black",
    "a peach": "orange",
}
COLOUR_NAMES = sorted(set(COLOURS.values()) | {"grey", "gold", "silver"})

# animal: (sound, baby, home, legs)
ANIMALS = {
    "cat": ("meow", "kitten", "a house", 4),
    "dog": ("woof", "puppy", "a kennel", 4),
    "cow": ("moo", "calf", "a barn", 4),
    "duck": ("quack", "duckling", "a pond", 2),
    "sheep": ("baa", "lamb", "a field", 4),
    "pig": ("oink", "piglet", "a sty", 4),
    "horse": ("neigh", "foal", "a stable", 4),
    "owl": ("hoot", "owlet", "a tree", 2),
    "lion": ("roar", "cub", "a den", 4),
    "frog": ("ribbit", "tadpole", "a pond", 4),
    "bee": ("buzz", "larva", "a hive", 6),
    "mouse": ("squeak", "pup", "a hole", 4),
    "hen": ("cluck", "chick", "a coop", 2),
    "goat": ("bleat", "kid", "a farm", 4),
    "snake": ("hiss", "snakelet", "a burrow", 0),
    "wolf": ("howl", "pup", "a den", 4),
    "bird": ("tweet", "chick", "a nest", 2),
    "donkey": ("hee-haw", "foal", "a field", 4),
    "bear": ("growl", "cub", "a cave", 4),
    "spider": ("nothing at all", "spiderling", "a web", 8),
    "rabbit": ("squeak", "kit", "a burrow", 4),
    "fox": ("yip", "kit", "a den", 4),
    "elephant": ("trumpet", "calf", "the savanna", 4),
    "monkey": ("ooh-ooh", "infant", "the jungle", 2),
    "turkey": ("gobble", "poult", "a farm", 2),
    "seal": ("bark", "pup", "the ice", 0),
    "ant": ("nothing at all", "larva", "an anthill", 6),
    "crab": ("click", "larva", "the beach", 10),
    "octopus": ("nothing at all", "larva", "the sea", 8),
    "kangaroo": ("chortle", "joey", "the bush", 2),
}

CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Germany": "Berlin",
    "England": "London",
    "China": "Beijing",
    "Russia": "Moscow",
    "Egypt": "Cairo",
    "Canada": "Ottawa",
    "Australia": "Canberra",
    "Brazil": "Brasilia",
    "India": "New Delhi",
    "Mexico": "Mexico City",
    "Kenya": "Nairobi",
    "Greece": "Athens",
    "Portugal": "Lisbon",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Ireland": "Dublin",
    "Poland": "Warsaw",
    "Austria": "Vienna",
    "Peru": "Lima",
    "Argentina": "Buenos Aires",
    "Chile": "Santiago",
    "Turkey": "Ankara",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "South Korea": "Seoul",
    "Cuba": "Havana",
    "Denmark": "Copenhagen",
    "Belgium": "Brussels",
    "Hungary": "Budapest",
    "Iceland": "Reykjavik",
    "Morocco": "Rabat",
    "Nigeria": "Abuja",
    "Ghana": "Accra",
    "Indonesia": "Jakarta",
    "the Netherlands": "Amsterdam",
}

OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "day": "night",
    "happy": "sad",
    "fast": "slow",
    "old": "young",
    "open": "closed",
    "wet": "dry",
    "light": "dark",
    "hard": "soft",
    "full": "empty",
    "tall": "short",
    "loud": "quiet",
    "early": "late",
    "near": "far",
    "left": "right",
    "rich": "poor",
    "strong": "weak",
    "clean": "dirty",
    "inside": "outside",
    "heavy": "light",
    "thick": "thin",
    "first": "last",
    "win": "lose",
    "push": "pull",
    "begin": "end",
    "true": "false",
}

SHAPES = {
    "triangle": 3,
    "square": 4,
    "rectangle": 4,
    "pentagon": 5,
    "hexagon": 6,
    "heptagon": 7,
    "octagon": 8,
    "circle": 0,
}

JOBS = {
    "baker": "bakes bread and cakes",
    "doctor": "helps sick people get better",
    "teacher": "helps children learn",
    "farmer": "grows food and looks after animals",
    "firefighter": "puts out fires",
    "pilot": "flies aeroplanes",
    "chef": "cooks food in a kitchen",
    "postman": "brings letters and parcels",
    "dentist": "looks after our teeth",
    "builder": "builds houses and walls",
    "gardener": "looks after plants and flowers",
    "painter": "paints pictures and walls",
    "nurse": "cares for patients in a hospital",
    "librarian": "looks after books in a library",
    "fisherman": "catches fish",
    "tailor": "makes and mends clothes",
    "vet": "helps sick animals",
    "driver": "drives a bus or a car",
    "police officer": "keeps people safe",
    "scientist": "does experiments to learn new things",
}

BOY_NAMES = [
    "Tom",
    "Ben",
    "Sam",
    "Max",
    "Leo",
    "Jack",
    "Noah",
    "Finn",
    "Oscar",
    "Theo",
    "Hugo",
    "Oliver",
    "Jake",
    "Harry",
    "Charlie",
    "Henry",
    "Arthur",
    "Freddie",
    "Alfie",
    "George",
    "Ethan",
    "Lucas",
    "Mason",
    "Liam",
    "Elijah",
    "James",
    "Aiden",
    "Felix",
    "Jasper",
    "Milo",
    "Ezra",
    "Ravi",
    "Kenji",
    "Omar",
    "Diego",
    "Mateo",
    "Ivan",
    "Kofi",
    "Wei",
    "Arjun",
    "Pablo",
    "Jonas",
    "Nils",
    "Tariq",
    "Caleb",
    "Peter",
    "Toby",
    "Rufus",
    "Bruno",
    "Otto",
]
GIRL_NAMES = [
    "Lily",
    "Mia",
    "Anna",
    "Lucy",
    "Emma",
    "Ella",
    "Zoe",
    "Ruby",
    "Grace",
    "Ivy",
    "Alice",
    "Chloe",
    "Sophie",
    "Daisy",
    "Rosie",
    "Molly",
    "Poppy",
    "Isla",
    "Evie",
    "Amelia",
    "Maya",
    "Nora",
    "Hazel",
    "Clara",
    "Stella",
    "Violet",
    "Luna",
    "Iris",
    "Willow",
    "Hannah",
    "Sara",
    "Priya",
    "Yuki",
    "Layla",
    "Sofia",
    "Lena",
    "Olga",
    "Amara",
    "Mei",
    "Zara",
    "Elena",
    "Freya",
    "Astrid",
    "Nadia",
    "Julia",
    "Wendy",
    "Holly",
    "Pippa",
    "Greta",
    "Heidi",
]
# Characters in stories are often animals; a name plus a kind reads naturally.
PET_NAMES = [
    "Pip",
    "Biscuit",
    "Whiskers",
    "Patch",
    "Button",
    "Pepper",
    "Ziggy",
    "Bramble",
    "Nibbles",
    "Sunny",
    "Coco",
    "Fluffy",
    "Shadow",
    "Tiny",
    "Bubbles",
    "Muffin",
    "Rascal",
    "Snowy",
    "Ginger",
    "Dotty",
    "Hopper",
    "Clover",
    "Maple",
    "Pebble",
    "Acorn",
    "Toffee",
    "Puddle",
    "Sprout",
]

ADJECTIVES = [
    "little",
    "brave",
    "curious",
    "kind",
    "shy",
    "clever",
    "happy",
    "sleepy",
    "funny",
    "gentle",
    "tiny",
    "busy",
    "friendly",
    "quiet",
    "silly",
    "proud",
    "helpful",
    "careful",
    "cheerful",
    "lazy",
    "playful",
    "wise",
    "young",
    "grumpy",
    "polite",
    "fluffy",
    "speedy",
    "hungry",
    "noisy",
    "lonely",
]

PLACES = [
    "a small village",
    "a big city",
    "a quiet forest",
    "a sunny meadow",
    "a green valley",
    "a cosy cottage",
    "a tall tower",
    "a busy farm",
    "a sandy beach",
    "a snowy mountain",
    "a little house by the river",
    "an old castle",
    "a bright garden",
    "a noisy town",
    "a hidden cave",
    "a wide field",
    "a blue lake",
    "a wooden cabin",
    "a busy harbour",
    "a peaceful island",
]

LANDMARKS = [
    "big oak tree",
    "old bridge",
    "river",
    "garden gate",
    "pond",
    "hill",
    "school",
    "market",
    "library",
    "park bench",
    "well",
    "fence",
    "barn",
    "lighthouse",
    "playground",
    "bakery",
    "station",
    "fountain",
    "haystack",
    "mailbox",
]

OBJECTS = [
    "ball",
    "kite",
    "box",
    "hat",
    "key",
    "book",
    "shell",
    "stone",
    "feather",
    "cup",
    "spoon",
    "sock",
    "scarf",
    "map",
    "bell",
    "drum",
    "flower",
    "leaf",
    "button",
    "ribbon",
    "marble",
    "coin",
    "boat",
    "balloon",
    "candle",
    "basket",
    "blanket",
    "brush",
    "bucket",
    "umbrella",
    "lantern",
    "whistle",
    "teddy bear",
    "toy car",
    "crayon",
    "pencil",
    "jar",
    "rope",
    "ring",
    "star",
]

FOODS = [
    "apples",
    "pears",
    "cookies",
    "cherries",
    "carrots",
    "eggs",
    "cakes",
    "plums",
    "nuts",
    "berries",
    "lemons",
    "muffins",
    "grapes",
    "oranges",
    "bananas",
    "sweets",
    "peaches",
    "potatoes",
    "tomatoes",
    "biscuits",
]

ACTIVITIES = [
    "play in the garden",
    "read books",
    "sing songs",
    "run in the park",
    "draw pictures",
    "climb trees",
    "swim in the lake",
    "bake cakes",
    "watch the clouds",
    "count the stars",
    "pick flowers",
    "build sandcastles",
    "ride a bike",
    "fly a kite",
    "play hide and seek",
    "dance in the rain",
    "collect shells",
    "plant seeds",
    "jump in puddles",
    "feed the ducks",
]

EMOTIONS = [
    "happy",
    "surprised",
    "excited",
    "proud",
    "curious",
    "glad",
    "amazed",
    "delighted",
    "thankful",
    "joyful",
]

WEATHER = ["sunny", "rainy", "windy", "snowy", "cloudy", "foggy", "stormy", "warm", "cold"]
WEATHER_CITIES = sorted(CAPITALS.values())

ASSISTANT_NAME = "MiniMind"
IDENTITY = "I am MiniMind, a small language model. I can answer simple questions and tell short stories."
SYSTEM_PROMPTS = [
    "You are MiniMind, a helpful assistant.",
    "You are MiniMind, a small and friendly AI assistant. Answer briefly.",
    "You are a helpful assistant. Keep your answers short and correct.",
    "You are MiniMind. Answer in one short sentence.",
]


def cap(text: str) -> str:
    """Upper-case the first letter only ('the sky' -> 'The sky')."""
    return text[:1].upper() + text[1:]


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


IRREGULAR_PLURALS = {"mouse": "mice", "sheep": "sheep", "wolf": "wolves", "fox": "foxes", "octopus": "octopuses"}


def plural(word: str) -> str:
    return IRREGULAR_PLURALS.get(word, word + "s")


def plural_s(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# --------------------------------------------------------------------------
# Fact sentences.  Each generator returns (question, answer) pairs; the
# pretraining text uses the answers, the chats use both.
# --------------------------------------------------------------------------


def arithmetic_fact(rng: random.Random) -> tuple[str, str]:
    op = rng.choice(["plus", "minus", "times"])
    if op == "plus":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        result = a + b
    elif op == "minus":
        a = rng.randint(0, 20)
        b = rng.randint(0, a)
        result = a - b
    else:
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        result = a * b
    question = rng.choice(
        [
            f"What is {a} {op} {b}?",
            f"How much is {a} {op} {b}?",
            f"Can you tell me what {a} {op} {b} is?",
            f"{a} {op} {b} = ?",
        ]
    )
    return question, f"{a} {op} {b} is {result}."


def number_fact(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 19)
    kind = rng.randrange(4)
    if kind == 0:
        return f"What number comes after {n}?", f"The number after {n} is {n + 1}."
    if kind == 1:
        m = n + 1
        return f"What number comes before {m}?", f"The number before {m} is {n}."
    if kind == 2:
        return f"How do you write {n} in words?", f"The number {n} is written as {NUMBER_WORDS[n]}."
    parity = "even" if n % 2 == 0 else "odd"
    return f"Is {n} odd or even?", f"{n} is an {parity} number."


def colour_fact(rng: random.Random) -> tuple[str, str]:
    thing = rng.choice(list(COLOURS))
    return f"What colour is {thing}?", f"{cap(thing)} is {COLOURS[thing]}."


def day_fact(rng: random.Random) -> tuple[str, str]:
    i = rng.randrange(7)
    kind = rng.randrange(3)
    if kind == 0:
        return (f"What day comes after {DAYS[i]}?", f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}.")
    if kind == 1:
        return (f"What day comes before {DAYS[i]}?", f"The day before {DAYS[i]} is {DAYS[(i - 1) % 7]}.")
    return "How many days are in a week?", "There are 7 days in a week."


def month_fact(rng: random.Random) -> tuple[str, str]:
    i = rng.randrange(12)
    kind = rng.randrange(4)
    if kind == 0:
        return (f"What month comes after {MONTHS[i]}?", f"The month after {MONTHS[i]} is {MONTHS[(i + 1) % 12]}.")
    if kind == 1:
        return (f"Which month of the year is {MONTHS[i]}?", f"{MONTHS[i]} is month number {i + 1} of the year.")
    if kind == 2:
        return (f"In which season is {MONTHS[i]}?", f"{MONTHS[i]} is in {SEASON_OF_MONTH[MONTHS[i]]}.")
    return "How many months are in a year?", "There are 12 months in a year."


def animal_fact(rng: random.Random) -> tuple[str, str]:
    animal = rng.choice(list(ANIMALS))
    sound, baby, home, legs = ANIMALS[animal]
    kind = rng.randrange(4)
    a = article(animal)
    if kind == 0:
        return f"What does {a} say?", f"{cap(a)} says {sound}."
    if kind == 1:
        return f"What is a baby {animal} called?", f"A baby {animal} is called {article(baby)}."
    if kind == 2:
        return f"Where does {a} live?", f"{cap(a)} lives in {home}."
    legs_text = "no legs" if legs == 0 else plural_s(legs, "leg")
    return f"How many legs does {a} have?", f"{cap(a)} has {legs_text}."


def capital_fact(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(list(CAPITALS))
    return (f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}.")


def opposite_fact(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(list(OPPOSITES))
    return (f"What is the opposite of {word}?", f"The opposite of {word} is {OPPOSITES[word]}.")


def shape_fact(rng: random.Random) -> tuple[str, str]:
    shape = rng.choice(list(SHAPES))
    sides = SHAPES[shape]
    if sides == 0:
        return "How many sides does a circle have?", "A circle has no straight sides. It is round."
    return f"How many sides does {article(shape)} have?", f"{cap(article(shape))} has {sides} sides."


def job_fact(rng: random.Random) -> tuple[str, str]:
    job = rng.choice(list(JOBS))
    return f"What does {article(job)} do?", f"{cap(article(job))} {JOBS[job]}."


FACT_TOPICS = [
    arithmetic_fact,
    arithmetic_fact,
    arithmetic_fact,
    number_fact,
    colour_fact,
    day_fact,
    month_fact,
    animal_fact,
    animal_fact,
    capital_fact,
    opposite_fact,
    shape_fact,
    job_fact,
]


def fact_paragraph(rng: random.Random) -> str:
    """A few facts about one topic, like a page of a children's fact book."""
    topic = rng.choice(FACT_TOPICS)
    facts: list[str] = []
    for _ in range(rng.randint(3, 8)):
        answer = topic(rng)[1]
        if answer not in facts:
            facts.append(answer)
    return " ".join(facts)


# --------------------------------------------------------------------------
# Stories.
# --------------------------------------------------------------------------

# Invented names for fairy-tale characters and lands.  They give the corpus
# (and so the tokenizer) enough distinct words to fill a 6400-token vocabulary,
# and each is repeated inside its story, which teaches copying from context.
SYLLABLES = [
    "ba",
    "be",
    "bo",
    "da",
    "di",
    "do",
    "fa",
    "fi",
    "ga",
    "go",
    "ka",
    "ki",
    "ko",
    "la",
    "li",
    "lo",
    "lu",
    "ma",
    "mi",
    "mo",
    "na",
    "ni",
    "no",
    "pa",
    "pe",
    "ra",
    "ri",
    "ro",
    "ru",
    "sa",
    "se",
    "si",
    "ta",
    "te",
    "to",
    "va",
    "vi",
    "za",
    "zo",
    "zu",
    "bel",
    "dor",
    "fen",
    "gar",
    "kin",
    "lan",
    "mor",
    "nim",
    "por",
    "quin",
    "sol",
    "tam",
    "vin",
    "wen",
    "yor",
]
LAND_ENDINGS = ["ia", "land", "vale", "wood", "shire", "mar", "dell", "holm"]
FANTASY_KINDS = ["dragon", "wizard", "fairy", "giant", "elf", "troll", "unicorn", "knight", "princess", "prince"]


def invented_word(rng: random.Random, ending: str = "") -> str:
    return cap("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))) + ending)


def fantasy_story(rng: random.Random) -> str:
    name, friend = invented_word(rng), invented_word(rng)
    land = invented_word(rng, rng.choice(LAND_ENDINGS))
    kind, friend_kind = rng.choice(FANTASY_KINDS), rng.choice(FANTASY_KINDS)
    obj, colour = rng.choice(OBJECTS), rng.choice(COLOUR_NAMES)
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    return " ".join(
        [
            f"Far away, in the land of {land}, there lived {article(rng.choice(ADJECTIVES))} {kind} named {name}.",
            f"Every morning, {name} walked to the {rng.choice(LANDMARKS)} of {land}.",
            f"One day, {name} found a {colour} {obj} that could talk.",
            f'"Please take me to {friend} the {friend_kind}," said the {obj}.',
            f"So {name} walked for {a} days, and then for {b} more days.",
            f"After {a + b} days, because {a} plus {b} is {a + b}, {name} met {friend}.",
            f"{friend} was {rng.choice(EMOTIONS)} to see the {colour} {obj} again.",
            f"{name} and {friend} became good friends, and {land} was happy for ever.",
        ]
    )


def make_character(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        kind = rng.choice(["boy", "girl"])
        name = rng.choice(BOY_NAMES if kind == "boy" else GIRL_NAMES)
        pronoun = "he" if kind == "boy" else "she"
    else:
        name = rng.choice(PET_NAMES)
        kind = rng.choice(list(ANIMALS))
        pronoun = rng.choice(["he", "she"])
    return {
        "name": name,
        "kind": kind,
        "he": pronoun,
        "his": "his" if pronoun == "he" else "her",
        "adj": rng.choice(ADJECTIVES),
    }


def story_counting(rng: random.Random, hero: dict) -> list[str]:
    food = rng.choice(FOODS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    total = a + b
    lines = [
        f"{hero['name']} had {a} {food}.",
        f"{cap(hero['his'])} friend gave {hero['name']} {b} more {food}.",
        f"Now {hero['name']} had {total} {food}, because {a} plus {b} is {total}.",
    ]
    if rng.random() < 0.5:
        eaten = rng.randint(1, total)
        lines.append(
            f"{cap(hero['he'])} ate {eaten} of them, so {total - eaten} {food} were left, "
            f"because {total} minus {eaten} is {total - eaten}."
        )
    return lines


def story_lost_and_found(rng: random.Random, hero: dict) -> list[str]:
    obj, colour = rng.choice(OBJECTS), rng.choice(COLOUR_NAMES)
    spot = rng.choice(LANDMARKS)
    return [
        f"One day, {hero['name']} lost {hero['his']} {colour} {obj}.",
        f"{cap(hero['he'])} looked everywhere, but {hero['he']} could not find it.",
        f"Then {hero['he']} looked near the {spot}, and there it was!",
        f"{hero['name']} was very {rng.choice(EMOTIONS)} to have {hero['his']} {obj} back.",
    ]


def story_friend(rng: random.Random, hero: dict) -> list[str]:
    friend = make_character(rng)
    activity = rng.choice(ACTIVITIES)
    return [
        f"One morning, {hero['name']} met {friend['name']}, a {friend['adj']} {friend['kind']}.",
        f'"Do you want to {activity} with me?" asked {hero["name"]}.',
        f'"Yes, please!" said {friend["name"]}.',
        f"So they went to {activity} together, and they had a lot of fun.",
        f"From that day on, {hero['name']} and {friend['name']} were best friends.",
    ]


def story_weather(rng: random.Random, hero: dict) -> list[str]:
    day = rng.choice(DAYS)
    weather = rng.choice(WEATHER)
    plan = rng.choice(ACTIVITIES)
    lines = [f"On {day}, the weather was {weather}."]
    if weather in ("rainy", "stormy", "snowy", "cold", "foggy"):
        lines += [
            f"{hero['name']} wanted to {plan}, but it was too {weather} outside.",
            f"So {hero['he']} stayed inside and read a book about {plural(rng.choice(list(ANIMALS)))}.",
            f"The next day was {DAYS[(DAYS.index(day) + 1) % 7]}, and the sun came out.",
            f"Then {hero['name']} could finally {plan}.",
        ]
    else:
        lines += [
            f"It was a perfect day to {plan}, so {hero['name']} went outside.",
            f"{cap(hero['he'])} had a wonderful time until the evening.",
        ]
    return lines


def story_helping(rng: random.Random, hero: dict) -> list[str]:
    job = rng.choice(list(JOBS))
    return [
        f"{hero['name']} saw {article(job)} who looked tired.",
        f"{cap(article(job))} {JOBS[job]}, and that is hard work.",
        f'"Can I help you?" asked {hero["name"]}.',
        f'The {job} smiled and said, "Thank you, that is very kind."',
        f"Helping others made {hero['name']} feel {rng.choice(EMOTIONS)}.",
    ]


STORY_MIDDLES = [story_counting, story_lost_and_found, story_friend, story_weather, story_helping]


def story(rng: random.Random) -> str:
    hero = make_character(rng)
    place = rng.choice(PLACES)
    lines = [
        rng.choice(
            [
                f"Once upon a time, there was a {hero['adj']} {hero['kind']} named {hero['name']}.",
                f"There once was a {hero['adj']} {hero['kind']} called {hero['name']}.",
                f"{hero['name']} was a {hero['adj']} {hero['kind']}.",
            ]
        ),
        f"{cap(hero['he'])} lived in {place} and liked to {rng.choice(ACTIVITIES)}.",
    ]
    for middle in rng.sample(STORY_MIDDLES, rng.randint(1, 2)):
        lines += middle(rng, hero)
    lines.append(
        rng.choice(
            [
                "The end.",
                f"That night, {hero['name']} went to sleep with a big smile.",
                f"And {hero['name']} lived happily ever after.",
            ]
        )
    )
    return " ".join(lines)


# --------------------------------------------------------------------------
# Chats.
# --------------------------------------------------------------------------

GREETINGS = [
    ("Hello!", "Hello! I am MiniMind. How can I help you today?"),
    ("Hi", "Hi! What would you like to know?"),
    ("Good morning!", "Good morning! How can I help you?"),
    ("Who are you?", IDENTITY),
    ("What is your name?", "My name is MiniMind."),
    (
        "What can you do?",
        "I can answer simple questions about numbers, colours, animals, "
        "days, months and countries, and I can tell short stories.",
    ),
    ("Thank you!", "You are welcome!"),
    ("Thanks for your help.", "You are welcome! Have a nice day."),
    ("Goodbye!", "Goodbye! Have a nice day."),
    ("Are you a human?", "No, I am MiniMind, a small language model."),
]

STORY_REQUESTS = [
    "Tell me a short story.",
    "Can you tell me a story?",
    "Please tell me a story for children.",
    "I would like to hear a short story.",
]


def single_qa(rng: random.Random) -> tuple[str, str]:
    roll = rng.random()
    if roll < 0.06:
        return rng.choice(GREETINGS)
    if roll < 0.11:
        return rng.choice(STORY_REQUESTS), story(rng)
    if roll < 0.14:
        return rng.choice(STORY_REQUESTS), fantasy_story(rng)
    return rng.choice(FACT_TOPICS)(rng)


def sft_conversation(rng: random.Random) -> list[dict]:
    messages: list[dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    # Mostly single-turn; some multi-turn so the model sees history.
    for _ in range(rng.choices([1, 2, 3], weights=[6, 3, 1])[0]):
        question, answer = single_qa(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get today's weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name."}},
            "required": ["city"],
        },
    },
}
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}


def tool_conversation(rng: random.Random) -> dict:
    """A chat where the assistant calls a tool and then answers from its result."""
    if rng.random() < 0.5:
        city, weather = rng.choice(WEATHER_CITIES), rng.choice(WEATHER)
        call = {"name": "get_weather", "arguments": {"city": city}}
        result = json.dumps({"city": city, "weather": weather})
        messages = [
            {"role": "user", "content": f"What is the weather like in {city} today?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": f"Today it is {weather} in {city}."},
        ]
    else:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        call = {"name": "add", "arguments": {"a": a, "b": b}}
        messages = [
            {"role": "user", "content": f"Please add {a} and {b}."},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "content": json.dumps({"result": a + b})},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        ]
    # Only the relevant tool is offered: it keeps the rows short enough for a
    # 256-token context.
    return {"conversations": messages, "tools": [WEATHER_TOOL if call["name"] == "get_weather" else ADD_TOOL]}


def wrong_answer(rng: random.Random, answer: str) -> str:
    """A plausible but wrong or unhelpful reply, for the DPO 'rejected' side."""
    if rng.random() < 0.25:
        return rng.choice(
            [
                "I don't know.",
                "That is a silly question.",
                "I don't want to answer that.",
                "Why do you ask? Go and look it up yourself.",
            ]
        )
    words = answer.rstrip(".").split(" ")
    # Prefer changing the last number; otherwise swap the last word for another
    # of the same sort (a colour for a colour, a day for a day, ...).
    digits = [i for i, w in enumerate(words) if w.isdigit()]
    if digits:
        i = digits[-1]
        n = int(words[i])
        words[i] = str(n + (rng.choice([-3, -2, -1, 1, 2, 3]) if n > 3 else rng.randint(1, 5)))
    else:
        last = words[-1]
        pools = [
            COLOUR_NAMES,
            DAYS,
            MONTHS,
            list(CAPITALS.values()),
            list(OPPOSITES.values()),
            NUMBER_WORDS,
            ["even", "odd"],
            ["winter", "spring", "summer", "autumn"],
        ]
        for pool in pools:
            if last in pool:
                words[-1] = rng.choice([w for w in pool if w != last])
                break
        else:
            return rng.choice(["I don't know.", "That is not something I can answer.", "Bananas are purple."])
    return " ".join(words) + "."


def dpo_pair(rng: random.Random) -> dict:
    question, answer = rng.choice(FACT_TOPICS)(rng)
    rejected = wrong_answer(rng, answer)
    while rejected == answer:
        rejected = wrong_answer(rng, answer)
    prompt = [{"role": "user", "content": question}]
    if rng.random() < 0.2:
        prompt.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return {
        "chosen": prompt + [{"role": "assistant", "content": answer}],
        "rejected": prompt + [{"role": "assistant", "content": rejected}],
    }


# --------------------------------------------------------------------------
# Reasoning chats: the assistant works the answer out in "reasoning_content"
# (rendered as a <think> block) before giving the same answer the other files
# teach.
# --------------------------------------------------------------------------


def _counting(start: int, steps: int, direction: int) -> str:
    return ", ".join(str(start + direction * k) for k in range(1, steps + 1))


def plus_reasoning(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    if b == 0:
        thought = f"Adding zero changes nothing, so {a} stays {a}."
    elif b <= 5:
        thought = f"Start at {a} and count on {b}: {_counting(a, b, 1)}. The last number is {a + b}."
    elif b < 10:
        thought = (
            f"{a} plus 10 is {a + 10}. {b} is {10 - b} less than 10, so take {10 - b} away: "
            f"{a + 10} minus {10 - b} is {a + b}."
        )
    else:
        thought = f"Split {b} into 10 and {b - 10}. {a} plus 10 is {a + 10}, and {a + 10} plus {b - 10} is {a + b}."
    return f"What is {a} plus {b}?", thought, f"{a} plus {b} is {a + b}."


def minus_reasoning(rng: random.Random) -> tuple[str, str, str]:
    a = rng.randint(0, 20)
    b = rng.randint(0, a)
    if b == 0:
        thought = f"Taking away zero changes nothing, so {a} stays {a}."
    elif b <= 5:
        thought = f"Start at {a} and count back {b}: {_counting(a, b, -1)}. The last number is {a - b}."
    else:
        thought = f"Which number plus {b} makes {a}? {b} plus {a - b} is {a}, so {a} minus {b} is {a - b}."
    return f"How much is {a} minus {b}?", thought, f"{a} minus {b} is {a - b}."


def times_reasoning(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(0, 10), rng.randint(0, 10)
    if b == 0:
        thought = f"Anything times zero is zero, so {a} times 0 is 0."
    elif b == 1:
        thought = f"Anything times one stays the same, so {a} times 1 is {a}."
    else:
        thought = f"{a} times {b} means adding {a} {b} times: {_counting(0, b, a)}. That makes {a * b}."
    return f"What is {a} times {b}?", thought, f"{a} times {b} is {a * b}."


def parity_reasoning(rng: random.Random) -> tuple[str, str, str]:
    n = rng.randint(0, 19)
    digit = n % 10
    parity = "even" if n % 2 == 0 else "odd"
    thought = (
        f"A number is even when its last digit is 0, 2, 4, 6 or 8. The last digit of {n} is {digit}, "
        f"which is {parity}."
    )
    return f"Is {n} odd or even?", thought, f"{n} is an {parity} number."


def day_reasoning(rng: random.Random) -> tuple[str, str, str]:
    i = rng.randrange(7)
    thought = (
        f"The week goes {', '.join(DAYS)}, and then starts again. "
        f"{DAYS[i]} is day {i + 1}, so the next one is {DAYS[(i + 1) % 7]}."
    )
    return f"What day comes after {DAYS[i]}?", thought, f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}."


def season_reasoning(rng: random.Random) -> tuple[str, str, str]:
    month = rng.choice(MONTHS)
    season = SEASON_OF_MONTH[month]
    thought = (
        "Winter is December, January and February; spring is March, April and May; summer is June, "
        f"July and August; autumn is September, October and November. {month} is in the {season} group."
    )
    return f"In which season is {month}?", thought, f"{month} is in {season}."


REASONING_TOPICS = [
    plus_reasoning,
    minus_reasoning,
    times_reasoning,
    parity_reasoning,
    day_reasoning,
    season_reasoning,
]


def reasoning_conversation(rng: random.Random) -> list[dict]:
    messages: list[dict] = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(rng.choices([1, 2], weights=[4, 1])[0]):
        question, thought, answer = rng.choice(REASONING_TOPICS)(rng)
        # Some replies skip the reasoning: an empty think block is exactly what enable_thinking=False puts in
        # the prompt, so these teach the model to answer straight after it.
        if rng.random() < 0.15:
            thought = ""
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer, "reasoning_content": thought},
        ]
    return messages


def reasoning_rows(rng: random.Random, n: int):
    for _ in range(n):
        yield {"conversations": reasoning_conversation(rng)}


# --------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------


def write_jsonl(path: Path, rows) -> tuple[int, int]:
    """Write rows as UTF-8 JSON lines; return (lines, bytes)."""
    count = 0
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count, path.stat().st_size


def pretrain_rows(rng: random.Random, n: int):
    for _ in range(n):
        roll = rng.random()
        if roll < 0.3:
            text = story(rng)
        elif roll < 0.55:
            text = fantasy_story(rng)
        else:
            text = fact_paragraph(rng)
        yield {"text": text}


def sft_rows(rng: random.Random, n: int):
    for _ in range(n):
        if rng.random() < 0.04:
            yield tool_conversation(rng)
        else:
            yield {"conversations": sft_conversation(rng)}


def dpo_rows(rng: random.Random, n: int):
    for _ in range(n):
        yield dpo_pair(rng)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Underscored like every other script's flags; the dashed spellings stay as aliases.
    parser.add_argument("--out_dir", "--out-dir", type=Path, default=Path(__file__).resolve().parent.parent / "data")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--pretrain_rows", "--pretrain-rows", type=int, default=6000)
    parser.add_argument("--sft_rows", "--sft-rows", type=int, default=5000)
    parser.add_argument("--dpo_rows", "--dpo-rows", type=int, default=400)
    parser.add_argument("--reasoning_rows", type=int, default=400)
    args = parser.parse_args(argv)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    # One independent stream per file, so changing one file's size does not
    # reshuffle the others.
    outputs = [
        ("pretrain.jsonl", pretrain_rows(random.Random(f"{args.seed}-pretrain"), args.pretrain_rows)),
        ("sft.jsonl", sft_rows(random.Random(f"{args.seed}-sft"), args.sft_rows)),
        ("dpo.jsonl", dpo_rows(random.Random(f"{args.seed}-dpo"), args.dpo_rows)),
        ("sft_reasoning.jsonl", reasoning_rows(random.Random(f"{args.seed}-reasoning"), args.reasoning_rows)),
    ]
    for name, rows in outputs:
        lines, size = write_jsonl(args.out_dir / name, rows)
        print(f"{args.out_dir / name}: {lines} lines, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
