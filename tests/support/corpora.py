"""Texts the tests feed models (embedding tests and the GGUF encoder's)."""
from __future__ import annotations


SENTENCES = [
    "Hello world!", "The quick brown fox jumps over the lazy dog.", "a", "Why is the sky blue?",
    "Rayleigh scattering makes short wavelengths scatter more than long ones.",
    "I love pizza.", "Pizza is my favourite food.", "The stock market fell sharply on Monday.",
    "Quantum computers use qubits.", "Le chat est sur la table.", "Der Hund bellt laut.",
    "東京は日本の首都です。", "Emoji test 🙂🚀✨", "def f(x): return x * 2", "SELECT * FROM users WHERE id = 1;",
    "12345 67890", "The mitochondria is the powerhouse of the cell.", "She sells sea shells by the sea shore.",
    "To be, or not to be, that is the question.", "It was the best of times, it was the worst of times.",
    "Machine learning models need data.", "Neural networks approximate functions.", "Paris is in France.",
    "Berlin is the capital of Germany.", "The weather today is sunny with a chance of rain.",
    "Please remember to bring your umbrella.", "Cats and dogs living together!", "UPPER CASE TEXT HERE",
    "mixed CaSe TeXt", "   leading and trailing spaces   ", "tab\tseparated\tvalues", "new\nline\ntext",
    "A very long sentence " + "that keeps going and going " * 20 + "until it finally stops.",
    "Short.", "Is this a question?", "This is not a question.", "Coffee or tea?", "Tea, please.",
    "The Eiffel Tower is 330 metres tall.", "Mount Everest is the highest mountain on Earth.",
    "Water boils at 100 degrees Celsius at sea level.", "Photosynthesis converts light into chemical energy.",
    "The cat sat on the mat.", "A dog chased the ball across the park.", "Bonjour, comment ça va ?",
    "¿Dónde está la biblioteca?", "Ελληνικά κείμενα", "Русский текст для проверки.", "ok", "The end.",
]
