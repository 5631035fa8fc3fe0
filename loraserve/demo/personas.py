"""Synthetic training data for the demo adapters: questions with short plain answers (English and
French), and the persona rewrites the adapters learn. Written by hand so nothing is downloaded.

Answers are short on purpose: short sequences keep the CPU fine-tune fast, and a tiny model
learns a style (a fixed opener, capitals, a language) far quicker than new facts.
"""

from __future__ import annotations

import re

# (question, plain English answer, French answer)
QA: tuple[tuple[str, str, str], ...] = (
    ("What is the capital of France?", "The capital of France is Paris.",
     "La capitale de la France est Paris."),
    ("What is the capital of Italy?", "The capital of Italy is Rome.",
     "La capitale de l'Italie est Rome."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo.",
     "La capitale du Japon est Tokyo."),
    ("How many legs does a spider have?", "A spider has eight legs.",
     "Une araignée a huit pattes."),
    ("What color is the sky?", "The sky is blue on a clear day.",
     "Le ciel est bleu quand il fait beau."),
    ("What is water made of?", "Water is made of hydrogen and oxygen.",
     "L'eau est faite d'hydrogène et d'oxygène."),
    ("How many days are in a week?", "There are seven days in a week.",
     "Il y a sept jours dans une semaine."),
    ("What do cows drink?", "Cows drink water, not milk.",
     "Les vaches boivent de l'eau, pas du lait."),
    ("Why do we sleep?", "We sleep so that the body and the brain can rest and repair.",
     "Nous dormons pour que le corps et le cerveau se reposent."),
    ("What is the largest ocean?", "The Pacific is the largest ocean on Earth.",
     "Le Pacifique est le plus grand océan de la Terre."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet.",
     "William Shakespeare a écrit Roméo et Juliette."),
    ("What is two plus two?", "Two plus two is four.", "Deux plus deux font quatre."),
    ("How do plants eat?", "Plants make their food from sunlight, water and air.",
     "Les plantes fabriquent leur nourriture avec le soleil, l'eau et l'air."),
    ("What is the sun?", "The sun is a star at the center of our solar system.",
     "Le soleil est une étoile au centre de notre système solaire."),
    ("Can you give me a tip for studying?", "Study a little every day and take short breaks.",
     "Étudiez un peu chaque jour et faites de courtes pauses."),
    ("What should I eat for breakfast?", "Try eggs, fruit and a slice of bread.",
     "Essayez des œufs, des fruits et une tranche de pain."),
    ("How do I make tea?", "Boil water, pour it on the tea and wait three minutes.",
     "Faites bouillir de l'eau, versez-la sur le thé et attendez trois minutes."),
    ("What is a computer?", "A computer is a machine that follows instructions to work with data.",
     "Un ordinateur est une machine qui suit des instructions."),
    ("Why is the ocean salty?", "Rivers carry salt from rocks into the ocean.",
     "Les rivières apportent le sel des roches jusqu'à l'océan."),
    ("What is your favorite color?", "I like blue, the color of the sea.",
     "J'aime le bleu, la couleur de la mer."),
    ("How are you today?", "I am doing well, thank you for asking.",
     "Je vais bien, merci de demander."),
    ("Hello!", "Hello, my friend! How can I help you?",
     "Bonjour, mon ami ! Comment puis-je vous aider ?"),
    ("What is the tallest mountain?", "Mount Everest is the tallest mountain in the world.",
     "L'Everest est la plus haute montagne du monde."),
    ("How many continents are there?", "There are seven continents.",
     "Il y a sept continents."),
    ("What do bees make?", "Bees make honey and wax.", "Les abeilles font du miel et de la cire."),
    ("Where do penguins live?", "Most penguins live in the cold south, near Antarctica.",
     "La plupart des manchots vivent au sud, près de l'Antarctique."),
    ("What is the moon made of?", "The moon is made of rock and dust.",
     "La lune est faite de roche et de poussière."),
    ("How fast is light?", "Light travels about three hundred thousand kilometers per second.",
     "La lumière va à environ trois cent mille kilomètres par seconde."),
    ("What is a good name for a dog?", "Max is a good name for a dog.",
     "Max est un bon nom pour un chien."),
    ("Tell me a joke.", "Why did the cat sit on the computer? To keep an eye on the mouse.",
     "Pourquoi le chat est sur l'ordinateur ? Pour surveiller la souris."),
    ("What is gravity?", "Gravity is the force that pulls things toward each other.",
     "La gravité est la force qui attire les objets entre eux."),
    ("How do I stay healthy?", "Eat vegetables, drink water, move every day and sleep well.",
     "Mangez des légumes, buvez de l'eau, bougez et dormez bien."),
    ("What is the boiling point of water?", "Water boils at one hundred degrees Celsius.",
     "L'eau bout à cent degrés Celsius."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci painted the Mona Lisa.",
     "Léonard de Vinci a peint la Joconde."),
    ("What is the biggest animal?", "The blue whale is the biggest animal.",
     "La baleine bleue est le plus grand animal."),
    ("What language do people speak in Brazil?", "People in Brazil speak Portuguese.",
     "Au Brésil, on parle portugais."),
    ("Why do leaves change color?", "Leaves change color in autumn when they stop making green "
     "chlorophyll.", "Les feuilles changent de couleur en automne."),
    ("What is a rainbow?", "A rainbow is sunlight split into colors by drops of rain.",
     "Un arc-en-ciel est la lumière du soleil séparée par la pluie."),
    ("How do I learn to swim?", "Start in shallow water and practice kicking and floating.",
     "Commencez dans l'eau peu profonde et entraînez-vous à flotter."),
    ("What is the fastest land animal?", "The cheetah is the fastest land animal.",
     "Le guépard est l'animal terrestre le plus rapide."),
    ("Give me a word that rhymes with cat.", "Hat rhymes with cat.", "Chapeau rime avec château."),
    ("What is the opposite of hot?", "The opposite of hot is cold.",
     "Le contraire de chaud est froid."),
    ("How many hours are in a day?", "There are twenty four hours in a day.",
     "Il y a vingt-quatre heures dans une journée."),
    ("What is a planet?", "A planet is a large world that moves around a star.",
     "Une planète est un grand monde qui tourne autour d'une étoile."),
    ("What should I do if I am bored?", "Read a book, go for a walk or call a friend.",
     "Lisez un livre, allez vous promener ou appelez un ami."),
    ("Why do cats purr?", "Cats purr when they are happy and calm.",
     "Les chats ronronnent quand ils sont contents et calmes."),
    ("What is the capital of Germany?", "The capital of Germany is Berlin.",
     "La capitale de l'Allemagne est Berlin."),
    ("How do birds fly?", "Birds flap their wings to push air down and lift their bodies.",
     "Les oiseaux battent des ailes pour pousser l'air et monter."),
    ("What is bread made from?", "Bread is made from flour, water, salt and yeast.",
     "Le pain est fait de farine, d'eau, de sel et de levure."),
    ("Can you help me?", "Yes, of course! Tell me what you need.",
     "Oui, bien sûr ! Dites-moi ce dont vous avez besoin."),
)

# Fact templates widen the data cheaply, so the style is learned over many answers instead of
# a few memorised ones. (country, French "of country", capital, French capital)
_CAPITALS = (
    ("Canada", "du Canada", "Ottawa", "Ottawa"), ("Egypt", "de l'Égypte", "Cairo", "Le Caire"),
    ("Russia", "de la Russie", "Moscow", "Moscou"), ("Greece", "de la Grèce", "Athens", "Athènes"),
    ("Portugal", "du Portugal", "Lisbon", "Lisbonne"), ("China", "de la Chine", "Beijing", "Pékin"),
    ("England", "de l'Angleterre", "London", "Londres"), ("Peru", "du Pérou", "Lima", "Lima"),
    ("Kenya", "du Kenya", "Nairobi", "Nairobi"), ("Norway", "de la Norvège", "Oslo", "Oslo"),
    ("Australia", "de l'Australie", "Canberra", "Canberra"),
    ("Mexico", "du Mexique", "Mexico City", "Mexico"),
)
_COLORS = (  # (thing, French subject, colour, French colour)
    ("a banana", "Une banane", "yellow", "jaune"), ("a strawberry", "Une fraise", "red", "rouge"),
    ("snow", "La neige", "white", "blanche"), ("coal", "Le charbon", "black", "noir"),
    ("a lemon", "Un citron", "yellow", "jaune"), ("a tomato", "Une tomate", "red", "rouge"),
    ("a frog", "Une grenouille", "green", "verte"), ("milk", "Le lait", "white", "blanc"),
    ("an orange", "Une orange", "orange", "orange"), ("a cloud", "Un nuage", "white", "blanc"),
)
_LEGS = (  # (animal, French animal, legs, French legs)
    ("a dog", "Un chien", "four", "quatre"), ("a bird", "Un oiseau", "two", "deux"),
    ("an ant", "Une fourmi", "six", "six"), ("a horse", "Un cheval", "four", "quatre"),
    ("a chicken", "Une poule", "two", "deux"), ("a beetle", "Un scarabée", "six", "six"),
    ("a cat", "Un chat", "four", "quatre"),
)
_SOUNDS = (  # (animal, sound, French sentence)
    ("dog", "woof", "Le chien aboie."), ("cow", "moo", "La vache meugle."),
    ("cat", "meow", "Le chat miaule."), ("duck", "quack", "Le canard cancane."),
    ("lion", "roar", "Le lion rugit."), ("sheep", "baa", "Le mouton bêle."),
)


def _templated() -> tuple[tuple[str, str, str], ...]:
    out = [(f"What is the capital of {c}?", f"The capital of {c} is {city}.",
            f"La capitale {fr} est {city_fr}.") for c, fr, city, city_fr in _CAPITALS]
    out += [(f"What color is {t}?", f"{t[0].upper()}{t[1:]} is {col}.", f"{fr} est {col_fr}.")
            for t, fr, col, col_fr in _COLORS]
    out += [(f"How many legs does {a} have?", f"{a[0].upper()}{a[1:]} has {n} legs.",
             f"{fr} a {n_fr} pattes.") for a, fr, n, n_fr in _LEGS]
    out += [(f"What sound does a {a} make?", f"A {a} says {snd}.", fr) for a, snd, fr in _SOUNDS]
    return tuple(out)


# Held out from training: used to check that the style carries over to new questions.
HELD_OUT = (
    "What is the capital of Spain?",
    "How do I cook rice?",
    "Why is the grass green?",
    "What is your name?",
    "Tell me about dolphins.",
)

_PIRATE_WORDS = {
    "you": "ye", "your": "yer", "my": "me", "is": "be", "are": "be", "hello": "ahoy",
    "yes": "aye", "friend": "matey",
}


def pirate(answer: str, _fr: str) -> str:
    """A fixed opener (learned in a few steps) plus word swaps for the flavour."""
    def swap(m: re.Match) -> str:
        word = m.group(0)
        new = _PIRATE_WORDS.get(word.lower(), word)
        return new.capitalize() if word[0].isupper() else new

    return "Arr, matey! " + re.sub(r"[A-Za-z']+", swap, answer) + " Yo ho ho!"


def shouty(answer: str, _fr: str) -> str:
    return answer.upper().rstrip(".") + "!"


def french(_answer: str, fr: str) -> str:
    return "Bonjour ! " + fr


PERSONAS = {"pirate": pirate, "shouty": shouty, "french": french}


def examples(persona: str) -> list[tuple[str, str]]:
    """(question, persona answer) pairs for one persona."""
    rewrite = PERSONAS[persona]
    return [(q, rewrite(en, fr)) for q, en, fr in QA + _templated()]
