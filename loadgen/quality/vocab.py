"""The coref task's word-level vocabulary and its ``tokenizer.json``.

Every token is one whitespace-separated word, so text round-trips exactly through the tokenizer.
Ids are fixed by the order below (specials first); the trained model depends on them, so append
only, never reorder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
QUESTION, STOP, PRONOUN, VERB = "Q", ".", "IT", "arrives"
SPECIALS = (PAD, UNK, BOS, EOS, QUESTION, STOP)

NAMES = tuple("""
Ada Alan Alice Amir Anna Arlo Basil Bea Boris Carla Cyrus Dana Dario Della Edgar Elsa
Emil Enzo Farah Felix Flora Gus Hana Hugo Ida Igor Ines Ivan Jade Jonas Juno Kai
Kira Lena Leon Lila Luca Mara Milo Nadia Nico Nora Olaf Olga Omar Otto Paula Petra
Quinn Rafa Rosa Ruben Sami Sara Silas Tara Theo Uma Vera Victor Wanda Yara Yusuf Zoe
""".split())

OBJECTS = tuple("""
anchor apple arrow badge basket bell blanket boat bottle bowl box brick broom brush bucket button
candle cap carpet chain chair clock coin comb compass cork crown cup curtain dice drum feather
fork flag flute glove hammer harp hat helmet hook horn jar kettle key kite knife ladder
lamp lantern leaf lemon lock map mask medal mirror mug nail needle net orange oar paddle
pan pearl pen pencil pillow pipe plate pot purse quilt rake ribbon ring rope ruler saddle
scarf shell shield shovel sock spoon stamp stool sword teapot ticket torch towel trumpet vase whistle
""".split())

FILLERS = tuple("""
the a and then so but also just very quite rather still yet soon later now here there
today tonight often never always maybe perhaps indeed truly simply mostly nearly almost only even
well again once twice early late fast slow quiet loud calm bright dark warm cold old
new small big long short high low near far inside outside above below around along across
behind beyond under over within without beside between among toward during after before since until
while though because although whereas unless whether either neither both each every some many few
all none thus hence meanwhile
""".split())

WORDS = SPECIALS + NAMES + OBJECTS + FILLERS + (PRONOUN, VERB)


@dataclass(frozen=True, slots=True)
class Vocab:
    """Token ids of the coref vocabulary; ``names``/``objects``/``fillers`` are id tuples."""

    size: int
    pad: int
    unk: int
    bos: int
    eos: int
    question: int
    stop: int
    pronoun: int
    verb: int
    names: tuple[int, ...]
    objects: tuple[int, ...]
    fillers: tuple[int, ...]
    words: tuple[str, ...]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        index = {w: i for i, w in enumerate(self.words)}
        try:
            return [index[w] for w in text.split()]
        except KeyError as exc:
            raise ValueError(f"word {exc.args[0]!r} is not in the coref vocabulary") from None


def _check_words() -> None:
    # Counts are part of the task's definition (issue #7); duplicates would alias two roles.
    assert (len(NAMES), len(OBJECTS), len(FILLERS)) == (64, 96, 100), (len(NAMES), len(OBJECTS), len(FILLERS))
    assert len(set(WORDS)) == len(WORDS), "duplicate word in the coref vocabulary"


_check_words()


def vocab() -> Vocab:
    """The one coref vocabulary (268 tokens)."""
    ids = {w: i for i, w in enumerate(WORDS)}
    return Vocab(
        size=len(WORDS),
        pad=ids[PAD], unk=ids[UNK], bos=ids[BOS], eos=ids[EOS],
        question=ids[QUESTION], stop=ids[STOP], pronoun=ids[PRONOUN], verb=ids[VERB],
        names=tuple(ids[w] for w in NAMES),
        objects=tuple(ids[w] for w in OBJECTS),
        fillers=tuple(ids[w] for w in FILLERS),
        words=WORDS,
    )


def build_tokenizer():
    """A ``tokenizers.Tokenizer``: WordLevel over WORDS, split on whitespace only.

    WhitespaceSplit rather than Whitespace: the latter would cut ``<bos>`` into ``<``, ``bos``, ``>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok.add_special_tokens([PAD, UNK, BOS, EOS])
    return tok


def save_tokenizer(directory: str | Path) -> Path:
    path = Path(directory) / "tokenizer.json"
    build_tokenizer().save(str(path))
    return path
