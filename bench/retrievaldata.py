"""
The retrieval benchmark's data set (bench/retrieval.py), made by the
project: generated conversations, each one agent's subject, whose turns
are the memories, and questions whose evidence is one turn.

Made, not collected, and deterministic for a seed. Each conversation
holds, shuffled together:

  - entity facts: a fact template filled with a person's name, a city, a
    date, a made-up company or book, a rare hobby or object (the things
    conversations are asked about); the same templates also come with
    other names and places in the same conversation, so that the question
    must find the right person's fact, not any fact of its kind; each is
    asked about in other words, sharing the entity (a name, a date, a
    rare word) and usually little else;
  - paraphrase facts: a fact asked about with (almost) none of its words
    ("I can't stand cilantro" / "Which herb do I dislike?"): only a model
    that knows meaning finds them;
  - small talk, most of the turns, some of it naming the conversation's
    people ("I had coffee with Oksana today") without saying anything
    asked about.

Every fact is asked about once. The proportions (by default 40 entity
facts, 8 paraphrase facts and 150 turns of small talk per conversation,
about 200 turns, as long conversations are) are a choice: the recall of
each mode is reported per kind of question too, so that a reader can
weigh them otherwise. A first version with 16 facts among 56 turns was
too easy for a real embedder (every question's fact was the only one of
its kind): the many facts of each kind here are what makes the names,
places and dates matter.
"""

from __future__ import annotations

import random

import attrs

NAMES = (
    "Anika Bergström Chiara Dmitri Esperanza Farrukh Giedrė Hiroshi Ingrid Jovan Kalani"
    " Leocadia Matteo Nnamdi Oksana Priyanka Quentin Rosalind Sigrún Tobias Ulrike Valentina"
    " Wojciech Xiomara Yusuf Zeynep Aurelio Bronwyn Casimir Delphine Evander Fionnuala Gustavo"
    " Hildegard Ifeoma Jarosław Kwabena Lucinda Mirela Nikolai Odalys Pieter Ragnhild Saoirse"
    " Thaddeus Undine Vesna Wilhelmina Yannick Zofia"
).split()
CITIES = (
    "Ljubljana Porto Tbilisi Valparaíso Kraków Oaxaca Tromsø Hobart Mombasa Cusco Aarhus Brno"
    " Izmir Nantes Trieste Göteborg Arequipa Kaunas Dunedin Halifax Windhoek Bergamo Plovdiv"
    " Tartu Salzburg Cádiz Leuven Galway Szeged Palermo"
).split()
MONTHS = (
    "January February March April May June July August September October November December"
).split()
COMPANIES = (
    "Brightwater Analytics|Quillfeather Press|Northgale Robotics|Emberlane Foods|Tidewright"
    " Logistics|Saltmarsh Studios|Copperfield Dental|Lumenstack|Greyhaven Insurance|Orchardine"
    " Labs|Vantorra Energy|Fernhollow Games|Kestrelwood Bank|Marrowby Architects|Pinecrest"
    " Biotech|Stormveil Media"
).split("|")
BOOKS = (
    "The Salt Orchard|Nine Lanterns for Odile|A Field Guide to Quiet|The Cartographer's"
    " Daughter|Letters from Vardø|The Glass Meridian|Small Hours in Lagos|The Weight of"
    " Feathers|Under the Linden|The Last Ferry to Hvar|Copper and Clay|The Moth Archive"
).split("|")
HOBBIES = (
    "kintsugi|theremin|bouldering|letterpress printing|falconry|glassblowing|beekeeping"
    "|calligraphy|fencing|woodturning|sailing|bookbinding|tango|archery|pottery|embroidery"
).split("|")
OBJECTS = (
    "telescope|sewing machine|kayak|tent|drone|typewriter|espresso grinder|ladder|snowboard"
    "|record player|projector|accordion|microscope|tandem bicycle"
).split("|")
RESTAURANTS = (
    "Casa Mirela|the Blue Heron|Osteria Lupa|Kafe Sonnet|the Copper Kettle|Bistro Ardent"
    "|Tavola Verde|the Lantern Room|Izakaya Hoshi|Chez Margaux"
).split("|")
BREEDS = "beagle|Maine Coon|greyhound|axolotl|corgi|Bengal cat|cockatiel|dachshund".split("|")
PETS = "Biscuit Pickle Nimbus Pepper Mochi Waffles Juniper Cricket Tofu Basil".split()

# (fact, question) with {name}, {city}, {date}, {company}, {book},
# {hobby}, {object}, {restaurant}, {breed}, {pet} to fill.
ENTITY_TEMPLATES = (
    ("{name} is moving to {city} on {date}.", "When is {name} moving?"),
    ("{name} is moving to {city} on {date}.", "Which city is {name} moving to?"),
    (
        "I signed up for a {hobby} class on Thursdays with {name}.",
        "Who do I take the {hobby} lessons with?",
    ),
    ("My cousin {name} just started a job at {company}.", "Where does {name} work now?"),
    (
        "We adopted a {breed} from the shelter and called it {pet}.",
        "What did we name our {breed}?",
    ),
    ("{name} told me I have to read {book}.", "Which book did {name} recommend to me?"),
    ("I lent my {object} to {name} last week.", "Who borrowed my {object}?"),
    (
        "We're celebrating {name}'s birthday at {restaurant} on {date}.",
        "Where is {name}'s birthday dinner?",
    ),
    ("My flight to {city} leaves on {date}, early in the morning.", "When do I fly to {city}?"),
    ("{name} and I are training for the half marathon in {city}.", "Who do I train with?"),
    ("The {object} I ordered should arrive on {date}.", "When is the {object} delivered?"),
    ("{name} got promoted to team lead at {company}.", "What happened to {name} at work?"),
)
# Asked in other words: what only meaning connects.
PARAPHRASE_FACTS = (
    ("I can't stand cilantro, it tastes like soap to me.", "Which herb do I dislike?"),
    ("I get seasick on every boat trip.", "Do ferries make me unwell?"),
    ("My knee still hurts since the marathon.", "Do I have a running injury?"),
    ("I'm allergic to peanuts, so no satay for me.", "What food allergy do I have?"),
    ("We finally paid off the mortgage this year.", "Do we still owe money on the house?"),
    ("I swapped coffee for green tea so I sleep better.", "What do I drink in the morning now?"),
    ("My daughter plays the cello in the school orchestra.", "Which instrument does my kid play?"),
    ("I stopped eating meat back in college.", "Am I vegetarian?"),
    ("The car broke down on the highway again.", "What went wrong with my vehicle?"),
    ("I'm terrified of heights, no rooftop bars please.", "Do I have any phobias?"),
    ("I've been practising Portuguese on my phone every morning.", "Which language am I studying?"),
    ("Our basement flooded after the storm.", "Did we have water damage at home?"),
    ("I sell handmade mugs at the market on weekends.", "What is my side business?"),
    ("My grandmother turns ninety next month.", "How old is granny going to be?"),
    ("I quit smoking three years ago.", "Do I still use cigarettes?"),
    ("We're expecting twins in the spring.", "Are we having a baby?"),
)
SMALL_TALK = (
    "Haha, that's funny.",
    "I had such a long day at work.",
    "The weather is lovely today.",
    "Let's talk later, I need to cook dinner.",
    "Thanks, that helps a lot.",
    "I'm so tired this week.",
    "Did you see the game last night?",
    "I need a holiday.",
    "That sounds like a good plan.",
    "Sorry, I was busy earlier.",
    "What do you think I should do?",
    "I'll think about it.",
    "Good morning!",
    "It's been raining all day.",
    "I finally cleaned the kitchen.",
    "My phone battery keeps dying.",
    "I watched a documentary about whales.",
    "Traffic was terrible this morning.",
    "I'm trying to drink more water.",
    "Can you remind me later?",
    "The neighbours are loud again.",
    "I made pancakes for breakfast.",
    "Work was fine, nothing special.",
    "I should go to bed earlier.",
    "We might go for a walk later.",
    "That meeting could have been an email.",
    "I forgot my umbrella again.",
    "The new series everyone talks about is okay.",
    "I need to buy groceries.",
    "My inbox is a mess.",
    "I'm listening to an old album today.",
    "The train was late as usual.",
    "I'm cooking something new tonight.",
    "It's too hot in the office.",
    "I started a puzzle with a thousand pieces.",
    "Weekend plans are still open.",
    "I had a strange dream last night.",
    "The coffee machine at work is broken.",
    "I'm saving up for something nice.",
    "Okay, sounds good.",
)
# Small talk that names someone of the conversation.
NAMED_SMALL_TALK = (
    "I had coffee with {name} today.",
    "{name} says hi.",
    "{name} sent me a funny video.",
    "I ran into {name} at the supermarket.",
    "{name} was in a bad mood this morning.",
    "I still owe {name} a call.",
)


@attrs.frozen
class Question:
    text: str
    evidence: int  # the index of the turn that answers it
    kind: str  # "entity" or "paraphrase"


@attrs.frozen
class Conversation:
    turns: tuple[str, ...]
    questions: tuple[Question, ...]


def _date(generator: random.Random) -> str:
    return f"{generator.choice(MONTHS)} {generator.randint(1, 28)}"


def conversation(
    generator: random.Random, entityFacts: int = 40, paraphraseFacts: int = 8, smallTalk: int = 150
) -> Conversation:
    facts: list[tuple[str, str, str]] = []
    names = generator.sample(NAMES, entityFacts + 4)
    for index in range(entityFacts):
        fact, question = ENTITY_TEMPLATES[generator.randrange(len(ENTITY_TEMPLATES))]
        slots = {
            "name": names[index],
            "city": generator.choice(CITIES),
            "date": _date(generator),
            "company": generator.choice(COMPANIES),
            "book": generator.choice(BOOKS),
            "hobby": generator.choice(HOBBIES),
            "object": generator.choice(OBJECTS),
            "restaurant": generator.choice(RESTAURANTS),
            "breed": generator.choice(BREEDS),
            "pet": generator.choice(PETS),
        }
        facts.append((fact.format(**slots), question.format(**slots), "entity"))
    for fact, question in generator.sample(PARAPHRASE_FACTS, paraphraseFacts):
        facts.append((fact, question, "paraphrase"))
    turns: list[tuple[str, int | None]] = [
        (fact, number) for number, (fact, _, _) in enumerate(facts)
    ]
    for _ in range(smallTalk):
        if generator.random() < 0.2:
            line = generator.choice(NAMED_SMALL_TALK).format(name=generator.choice(names))
        else:
            line = generator.choice(SMALL_TALK)
        turns.append((line, None))
    generator.shuffle(turns)
    where = {number: index for index, (_, number) in enumerate(turns) if number is not None}
    return Conversation(
        turns=tuple(text for text, _ in turns),
        questions=tuple(
            Question(question, where[number], kind)
            for number, (_, question, kind) in enumerate(facts)
        ),
    )


def conversations(seed: int, count: int) -> list[Conversation]:
    generator = random.Random(seed)
    return [conversation(generator) for _ in range(count)]
