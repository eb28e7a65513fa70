"""Training data for the demo's LoRA adapters, generated here from small tables (no download).

Four styles of answer to the same simple questions (capitals, sums, colours):

  french   the answer in French             "La capitale de l'Italie est Rome."
  pirate   the answer as a pirate            "Arr, matey! The capital o' Italy be Rome, savvy?"
  json     the answer as a JSON object       {"country": "Italy", "capital": "Rome"}
  sql      the SQL query that would answer   SELECT capital FROM countries WHERE name = 'Italy';

The questions the demo asks (`DEMO_QUESTIONS`) are held out of the training data, so the demo shows
each adapter applying its style to a question it never saw.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

STYLES = ("french", "pirate", "json", "sql")

# country, capital, French name with its article ("de" + it), French capital
COUNTRIES: list[tuple[str, str, str, str]] = [
    ("France", "Paris", "la France", "Paris"),
    ("Italy", "Rome", "l'Italie", "Rome"),
    ("Spain", "Madrid", "l'Espagne", "Madrid"),
    ("Germany", "Berlin", "l'Allemagne", "Berlin"),
    ("Portugal", "Lisbon", "le Portugal", "Lisbonne"),
    ("Japan", "Tokyo", "le Japon", "Tokyo"),
    ("China", "Beijing", "la Chine", "Pékin"),
    ("Russia", "Moscow", "la Russie", "Moscou"),
    ("Egypt", "Cairo", "l'Égypte", "Le Caire"),
    ("Greece", "Athens", "la Grèce", "Athènes"),
    ("Poland", "Warsaw", "la Pologne", "Varsovie"),
    ("Austria", "Vienna", "l'Autriche", "Vienne"),
    ("Norway", "Oslo", "la Norvège", "Oslo"),
    ("Sweden", "Stockholm", "la Suède", "Stockholm"),
    ("Finland", "Helsinki", "la Finlande", "Helsinki"),
    ("Denmark", "Copenhagen", "le Danemark", "Copenhague"),
    ("Ireland", "Dublin", "l'Irlande", "Dublin"),
    ("Belgium", "Brussels", "la Belgique", "Bruxelles"),
    ("Canada", "Ottawa", "le Canada", "Ottawa"),
    ("Mexico", "Mexico City", "le Mexique", "Mexico"),
    ("Peru", "Lima", "le Pérou", "Lima"),
    ("Chile", "Santiago", "le Chili", "Santiago"),
    ("Argentina", "Buenos Aires", "l'Argentine", "Buenos Aires"),
    ("Kenya", "Nairobi", "le Kenya", "Nairobi"),
    ("India", "New Delhi", "l'Inde", "New Delhi"),
    ("Thailand", "Bangkok", "la Thaïlande", "Bangkok"),
    ("Turkey", "Ankara", "la Turquie", "Ankara"),
    ("Hungary", "Budapest", "la Hongrie", "Budapest"),
    ("Cuba", "Havana", "Cuba", "La Havane"),
    ("Morocco", "Rabat", "le Maroc", "Rabat"),
]
# thing, colour, French thing (with article), French colour (agreeing with it)
COLOURS: list[tuple[str, str, str, str]] = [
    ("the sky", "blue", "le ciel", "bleu"),
    ("grass", "green", "l'herbe", "verte"),
    ("snow", "white", "la neige", "blanche"),
    ("a banana", "yellow", "une banane", "jaune"),
    ("coal", "black", "le charbon", "noir"),
    ("a strawberry", "red", "une fraise", "rouge"),
    ("a carrot", "orange", "une carotte", "orange"),
    ("milk", "white", "le lait", "blanc"),
    ("a lemon", "yellow", "un citron", "jaune"),
    ("a tomato", "red", "une tomate", "rouge"),
    ("the sea", "blue", "la mer", "bleue"),
    ("a leaf", "green", "une feuille", "verte"),
]
CAPITAL_QUESTIONS = ("What is the capital of {c}?", "Which city is the capital of {c}?", "Tell me the capital of {c}.")
SUM_QUESTIONS = ("What is {a} plus {b}?", "How much is {a} plus {b}?")
COLOUR_QUESTIONS = ("What colour is {t}?", "What is the colour of {t}?")

# The demo asks these of the base model and of every adapter; none is in the training data.
DEMO_QUESTIONS = ("What is the capital of France?", "What is 7 plus 5?", "What colour is the sky?")
_HELD_OUT_COUNTRIES = {"France"}
_HELD_OUT_SUMS = {(7, 5)}
_HELD_OUT_THINGS = {"the sky"}


@dataclass(frozen=True)
class Example:
    question: str
    answer: str


def _capital(style: str, country: str, capital: str, fr_country: str, fr_capital: str) -> str:
    de = "du " + fr_country[3:] if fr_country.startswith("le ") else "de " + fr_country
    answers: dict[str, Callable[[], str]] = {
        "french": lambda: f"La capitale {de} est {fr_capital}.",
        "pirate": lambda: f"Arr, matey! The capital o' {country} be {capital}, savvy?",
        "json": lambda: json.dumps({"country": country, "capital": capital}),
        "sql": lambda: f"SELECT capital FROM countries WHERE name = '{country}';",
    }
    return answers[style]()


def _sum(style: str, a: int, b: int) -> str:
    answers = {
        "french": f"{a} plus {b} font {a + b}.",
        "pirate": f"Arr! {a} plus {b} be {a + b}, me hearty!",
        "json": json.dumps({"operation": "add", "a": a, "b": b, "result": a + b}),
        "sql": f"SELECT {a} + {b} AS result;",
    }
    return answers[style]


def _colour(style: str, thing: str, colour: str, fr_thing: str, fr_colour: str) -> str:
    answers = {
        "french": f"{fr_thing[0].upper()}{fr_thing[1:]} est {fr_colour}.",
        "pirate": f"Arr, {thing} be {colour}, as sure as the tide!",
        "json": json.dumps({"thing": thing, "colour": colour}),
        "sql": f"SELECT colour FROM things WHERE name = '{thing}';",
    }
    return answers[style]


def examples(style: str, seed: int = 0) -> list[Example]:
    """Every training example of one style (the demo's questions left out), shuffled with `seed`."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; known: {', '.join(STYLES)}")
    rng = random.Random(seed)
    out = []
    for i, (country, capital, fr_country, fr_capital) in enumerate(COUNTRIES):
        if country not in _HELD_OUT_COUNTRIES:
            q = CAPITAL_QUESTIONS[i % len(CAPITAL_QUESTIONS)].format(c=country)
            out.append(Example(q, _capital(style, country, capital, fr_country, fr_capital)))
    sums = [(a, b) for a in range(2, 10) for b in range(2, 10) if (a, b) not in _HELD_OUT_SUMS]
    for i, (a, b) in enumerate(rng.sample(sums, 24)):
        out.append(Example(SUM_QUESTIONS[i % len(SUM_QUESTIONS)].format(a=a, b=b), _sum(style, a, b)))
    for i, (thing, colour, fr_thing, fr_colour) in enumerate(COLOURS):
        if thing not in _HELD_OUT_THINGS:
            q = COLOUR_QUESTIONS[i % len(COLOUR_QUESTIONS)].format(t=thing)
            out.append(Example(q, _colour(style, thing, colour, fr_thing, fr_colour)))
    rng.shuffle(out)
    return out
