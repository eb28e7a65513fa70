"""Training data for the demo's LoRA adapters, generated here from small tables (no download).

Four styles of answer to the same simple questions (capitals, sums, colours):

  french   the answer in French             "La capitale de l'Italie est Rome."
  pirate   the answer as a pirate            "Arr, matey! The capital o' Italy be Rome, savvy?"
  json     the answer as a JSON object       {"country": "Italy", "capital": "Rome"}
  sql      the SQL query that would answer   SELECT capital FROM countries WHERE name = 'Italy';

and a fifth adapter, `tools`, for `tool_choice: "auto"` (SmolLM2 was never trained for tools): the
same questions answered in plain English, weather and time questions answered with a Hermes tool
call (`<tool_call>{"name": "get_weather", "arguments": {...}}</tool_call>`, what the worker's
`--tool-call-parser hermes` reads), and a tool's result (a `role: "tool"` message) answered in words.

The questions the demo asks (`DEMO_QUESTIONS`, `TOOL_QUESTION`) are held out of the training data,
so the demo shows each adapter applying its style to a question it never saw.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The four answer styles of the same questions; every adapter the demo trains is these and `tools`.
STYLES = ("french", "pirate", "json", "sql")
TOOLS_STYLE = "tools"
ADAPTERS = (*STYLES, TOOLS_STYLE)

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

# The tools the `tools` adapter calls (OpenAI's shape; every request of its training data sends them).
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
WEATHER_QUESTIONS = ("What is the weather in {c}?", "What's the weather like in {c} today?", "Is it raining in {c}?",
                     "How warm is it in {c} right now?")  # fmt: skip
FAHRENHEIT_QUESTION = "What is the temperature in {c} in Fahrenheit?"
TIME_QUESTIONS = ("What time is it in {c}?", "What is the local time in {c}?")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "foggy")
# The demo and the tests ask the tools adapter about this city; it is in no training example.
TOOL_QUESTION = "What is the weather in Paris?"
_HELD_OUT_CITIES = {"Paris"}


@dataclass(frozen=True)
class Example:
    """A user question and the answer to learn; `context` are the messages between them (an assistant's
    tool call and its result) and `tools` the request's tools."""

    question: str
    answer: str
    context: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] = field(default=(), repr=False)

    def messages(self) -> list[dict[str, Any]]:
        """The conversation up to the answer, as an OpenAI chat request sends it."""
        return [{"role": "user", "content": self.question}, *self.context]


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


def _plain(question: str, answer: str) -> Example:
    """A question the tools adapter answers in words although the request offers tools."""
    return Example(question, answer, tools=tuple(TOOLS))


def _call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the Hermes format writes it."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _called(question: str, name: str, arguments: dict[str, Any], result: dict[str, Any], answer: str) -> list[Example]:
    """The call a question asks for, and the answer in words once the tool's result comes back."""
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    context = ({"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(result)})  # fmt: skip
    return [Example(question, _call(name, arguments), tools=tuple(TOOLS)),
            Example(question, answer, context, tools=tuple(TOOLS))]  # fmt: skip


def tool_examples(seed: int = 0) -> list[Example]:
    """The `tools` adapter's examples: plain answers, weather and time calls, answers from tool results."""
    rng = random.Random(seed)
    out = []
    for i, (country, capital, _, _) in enumerate(COUNTRIES):
        if country not in _HELD_OUT_COUNTRIES:
            out.append(_plain(CAPITAL_QUESTIONS[i % len(CAPITAL_QUESTIONS)].format(c=country),
                              f"The capital of {country} is {capital}."))  # fmt: skip
        if capital in _HELD_OUT_CITIES:
            continue
        degrees, condition = rng.randint(-5, 32), CONDITIONS[i % len(CONDITIONS)]
        if i % 5 == 4:
            question, unit, degrees = FAHRENHEIT_QUESTION.format(c=capital), "fahrenheit", degrees * 9 // 5 + 32
        else:
            question, unit = WEATHER_QUESTIONS[i % len(WEATHER_QUESTIONS)].format(c=capital), "celsius"
        out += _called(question, "get_weather", {"city": capital, "unit": unit},
                       {"city": capital, "temperature": degrees, "unit": unit, "condition": condition},
                       f"It is {condition} in {capital}, {degrees} degrees {unit}.")  # fmt: skip
        clock = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        out += _called(TIME_QUESTIONS[i % len(TIME_QUESTIONS)].format(c=capital), "get_time", {"city": capital},
                       {"city": capital, "time": clock}, f"It is {clock} in {capital}.")  # fmt: skip
    sums = [(a, b) for a in range(2, 10) for b in range(2, 10) if (a, b) not in _HELD_OUT_SUMS]
    for i, (a, b) in enumerate(rng.sample(sums, 24)):
        out.append(_plain(SUM_QUESTIONS[i % len(SUM_QUESTIONS)].format(a=a, b=b), f"{a} plus {b} is {a + b}."))
    for i, (thing, colour, _, _) in enumerate(COLOURS):
        if thing not in _HELD_OUT_THINGS:
            out.append(_plain(COLOUR_QUESTIONS[i % len(COLOUR_QUESTIONS)].format(t=thing),
                              f"{thing[0].upper()}{thing[1:]} is {colour}."))  # fmt: skip
    rng.shuffle(out)
    return out


def examples(style: str, seed: int = 0) -> list[Example]:
    """Every training example of one adapter (the demo's questions left out), shuffled with `seed`."""
    if style == TOOLS_STYLE:
        return tool_examples(seed)
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; known: {', '.join(ADAPTERS)}")
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
