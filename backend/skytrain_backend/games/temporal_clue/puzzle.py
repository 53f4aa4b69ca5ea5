"""A generator of small "who did it, with what, where and when" puzzles with a unique answer.

The rule of the game: at the murder hour the murderer was the only suspect in the murder room
and the weapon the only weapon there. The generator draws a hidden evening that obeys it: where
every suspect and every weapon was at every hour, such that at the murder hour no other room
holds exactly one suspect and one weapon. Each clue is a fact true of that evening (where
someone or something was at some hour, when the victim was last seen...). Read with the rule,
a clue rules out some (suspect, weapon, room, hour) answers. Clues are added in random order
until exactly one answer survives, every clue the others make redundant is dropped, and the
uniqueness of the answer is checked again by trying every possible answer.
"""

from __future__ import annotations

import abc
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

SUSPECTS = (
    "Miss Scarlet",
    "Colonel Mustard",
    "Mrs. White",
    "Mr. Green",
    "Mrs. Peacock",
    "Professor Plum",
)
WEAPONS = ("Candlestick", "Knife", "Lead Pipe", "Revolver", "Rope", "Wrench")
ROOMS = ("Kitchen", "Ballroom", "Library", "Study", "Hall", "Lounge")
HOURS = ("6 pm", "7 pm", "8 pm", "9 pm", "10 pm", "11 pm")
QUESTIONS = ("suspect", "weapon", "room", "time")


@dataclass(frozen=True)
class Solution:
    suspect: str
    weapon: str
    room: str
    time: str


@dataclass(frozen=True)
class Cast:
    """The suspects, weapons, rooms and hours (in order) of one puzzle."""

    suspects: tuple[str, ...]
    weapons: tuple[str, ...]
    rooms: tuple[str, ...]
    hours: tuple[str, ...]

    def answers(self) -> list[Solution]:
        return [
            Solution(*values)
            for values in itertools.product(self.suspects, self.weapons, self.rooms, self.hours)
        ]

    def hour_index(self, hour: str) -> int:
        return self.hours.index(hour)


class Clue(abc.ABC):
    """A fact about the evening; ``allows`` says whether an answer is still possible with it."""

    @abc.abstractmethod
    def allows(self, answer: Solution, cast: Cast) -> bool: ...

    @abc.abstractmethod
    def text(self) -> str: ...


def _placed_at_murder(is_culprit: bool, in_room: bool) -> bool:
    """Someone (or something) seen in a room at the murder hour is the culprit (the weapon)
    exactly when that room is the murder room, since the culprit was the only one there."""
    return is_culprit == in_room


@dataclass(frozen=True)
class SuspectAt(Clue):
    suspect: str
    room: str
    time: str

    def allows(self, answer: Solution, cast: Cast) -> bool:
        return answer.time != self.time or _placed_at_murder(
            answer.suspect == self.suspect, answer.room == self.room
        )

    def text(self) -> str:
        return f"At {self.time}, {self.suspect} was in the {self.room}."


@dataclass(frozen=True)
class WeaponAt(Clue):
    weapon: str
    room: str
    time: str

    def allows(self, answer: Solution, cast: Cast) -> bool:
        return answer.time != self.time or _placed_at_murder(
            answer.weapon == self.weapon, answer.room == self.room
        )

    def text(self) -> str:
        return f"At {self.time}, the {self.weapon} was in the {self.room}."


@dataclass(frozen=True)
class SuspectStayed(Clue):
    suspect: str
    room: str
    start: str
    end: str

    def allows(self, answer: Solution, cast: Cast) -> bool:
        during = (
            cast.hour_index(self.start) <= cast.hour_index(answer.time) <= cast.hour_index(self.end)
        )
        return not during or _placed_at_murder(
            answer.suspect == self.suspect, answer.room == self.room
        )

    def text(self) -> str:
        return f"{self.suspect} stayed in the {self.room} from {self.start} until {self.end}."


@dataclass(frozen=True)
class WeaponNeverIn(Clue):
    weapon: str
    room: str

    def allows(self, answer: Solution, cast: Cast) -> bool:
        return not (answer.weapon == self.weapon and answer.room == self.room)

    def text(self) -> str:
        return f"The {self.weapon} was never in the {self.room}."


@dataclass(frozen=True)
class SuspectNeverIn(Clue):
    suspect: str
    room: str

    def allows(self, answer: Solution, cast: Cast) -> bool:
        return not (answer.suspect == self.suspect and answer.room == self.room)

    def text(self) -> str:
        return f"{self.suspect} never set foot in the {self.room}."


@dataclass(frozen=True)
class RoomEmpty(Clue):
    room: str
    time: str

    def allows(self, answer: Solution, cast: Cast) -> bool:
        return not (answer.room == self.room and answer.time == self.time)

    def text(self) -> str:
        return f"Nobody was in the {self.room} at {self.time}."


@dataclass(frozen=True)
class HappenedAfter(Clue):
    time: str

    def allows(self, answer: Solution, cast: Cast) -> bool:
        return cast.hour_index(answer.time) > cast.hour_index(self.time)

    def text(self) -> str:
        return f"The victim was seen alive at {self.time}."


@dataclass(frozen=True)
class HappenedBefore(Clue):
    time: str

    def allows(self, answer: Solution, cast: Cast) -> bool:
        return cast.hour_index(answer.time) < cast.hour_index(self.time)

    def text(self) -> str:
        return f"The body was found at {self.time}."


@dataclass(frozen=True)
class Puzzle:
    cast: Cast
    clues: tuple[Clue, ...]
    solution: Solution
    seed: int

    def text(self) -> str:
        clues = "\n".join(f"{i}. {clue.text()}" for i, clue in enumerate(self.clues, start=1))
        return (
            f"A murder happened at the manor. Suspects: {', '.join(self.cast.suspects)}. "
            f"Weapons: {', '.join(self.cast.weapons)}. Rooms: {', '.join(self.cast.rooms)}. "
            f"Times: {', '.join(self.cast.hours)}. At the time of the murder, the murderer was "
            "the only suspect in the murder room and the weapon the only weapon there."
            f"\n\nClues:\n{clues}"
        )


def solve(cast: Cast, clues: Sequence[Clue]) -> list[Solution]:
    """Every answer consistent with all the clues, found by trying each one."""
    return [answer for answer in cast.answers() if all(c.allows(answer, cast) for c in clues)]


def _facts(
    cast: Cast,
    solution: Solution,
    suspect_rooms: dict[str, list[str]],
    weapon_rooms: dict[str, list[str]],
) -> list[Clue]:
    """Every clue of the timed kinds that is true of the hidden evening."""
    facts: list[Clue] = []
    for suspect, rooms in suspect_rooms.items():
        facts += [
            SuspectAt(suspect, room, hour) for room, hour in zip(rooms, cast.hours, strict=True)
        ]
        facts += [SuspectNeverIn(suspect, room) for room in cast.rooms if room not in rooms]
        for start, end in itertools.combinations(range(len(cast.hours)), 2):
            if len(set(rooms[start : end + 1])) == 1:
                facts.append(
                    SuspectStayed(suspect, rooms[start], cast.hours[start], cast.hours[end])
                )
    for weapon, rooms in weapon_rooms.items():
        facts += [
            WeaponAt(weapon, room, hour) for room, hour in zip(rooms, cast.hours, strict=True)
        ]
        facts += [WeaponNeverIn(weapon, room) for room in cast.rooms if room not in rooms]
    for h, hour in enumerate(cast.hours):
        occupied = {rooms[h] for rooms in suspect_rooms.values()}
        facts += [RoomEmpty(room, hour) for room in cast.rooms if room not in occupied]
    murder = cast.hour_index(solution.time)
    facts += [HappenedAfter(hour) for hour in cast.hours[:murder]]
    facts += [HappenedBefore(hour) for hour in cast.hours[murder + 1 :]]
    return facts


def _place_at_murder_hour(
    rng: random.Random,
    cast: Cast,
    solution: Solution,
    suspect_rooms: dict[str, list[str]],
    weapon_rooms: dict[str, list[str]],
) -> None:
    """Put everyone at the murder hour so that only the murder room fits the rule.

    The others go to the other rooms at random; a draw that leaves some other room with exactly
    one suspect and one weapon (a second answer the clues could never rule out) is redrawn.
    With at least three rooms, all other suspects in one room and all other weapons in another
    always works, so the redraws are bounded by that placement.
    """
    murder = cast.hour_index(solution.time)
    elsewhere = [room for room in cast.rooms if room != solution.room]
    others = [s for s in cast.suspects if s != solution.suspect]
    other_weapons = [w for w in cast.weapons if w != solution.weapon]
    for _ in range(100):
        people = {s: rng.choice(elsewhere) for s in others}
        things = {w: rng.choice(elsewhere) for w in other_weapons}
        rooms_people = [list(people.values()).count(room) for room in elsewhere]
        rooms_things = [list(things.values()).count(room) for room in elsewhere]
        if not any(p == 1 and t == 1 for p, t in zip(rooms_people, rooms_things, strict=True)):
            break
    else:
        people = dict.fromkeys(others, elsewhere[0])
        things = dict.fromkeys(other_weapons, elsewhere[1])
    for name, room in people.items():
        suspect_rooms[name][murder] = room
    for name, room in things.items():
        weapon_rooms[name][murder] = room
    suspect_rooms[solution.suspect][murder] = solution.room
    weapon_rooms[solution.weapon][murder] = solution.room


def check_sizes(*, suspects: int, weapons: int, rooms: int, hours: int) -> None:
    """Refuse sizes the name pools cannot fill; three rooms at least (see the placement)."""
    for name, value, pool in (
        ("suspects", suspects, SUSPECTS),
        ("weapons", weapons, WEAPONS),
        ("rooms", rooms, ROOMS),
        ("hours", hours, HOURS),
    ):
        least = 3 if name == "rooms" else 2
        if not least <= value <= len(pool):
            raise ValueError(f"{name} must be between {least} and {len(pool)}, got {value}")


def generate_puzzle(
    seed: int, *, suspects: int = 3, weapons: int = 3, rooms: int = 3, hours: int = 4
) -> Puzzle:
    """A puzzle with exactly one answer; the same seed and sizes always give the same puzzle."""
    check_sizes(suspects=suspects, weapons=weapons, rooms=rooms, hours=hours)
    rng = random.Random(seed)
    first_hour = rng.randrange(len(HOURS) - hours + 1)
    cast = Cast(
        suspects=tuple(rng.sample(SUSPECTS, suspects)),
        weapons=tuple(rng.sample(WEAPONS, weapons)),
        rooms=tuple(rng.sample(ROOMS, rooms)),
        hours=HOURS[first_hour : first_hour + hours],
    )
    solution = Solution(
        rng.choice(cast.suspects),
        rng.choice(cast.weapons),
        rng.choice(cast.rooms),
        rng.choice(cast.hours),
    )
    suspect_rooms = {s: [rng.choice(cast.rooms) for _ in cast.hours] for s in cast.suspects}
    weapon_rooms = {w: [rng.choice(cast.rooms) for _ in cast.hours] for w in cast.weapons}
    _place_at_murder_hour(rng, cast, solution, suspect_rooms, weapon_rooms)

    facts = _facts(cast, solution, suspect_rooms, weapon_rooms)
    rng.shuffle(facts)

    clues: list[Clue] = []
    remaining = cast.answers()
    for clue in facts:
        narrowed = [answer for answer in remaining if clue.allows(answer, cast)]
        if len(narrowed) < len(remaining):
            clues.append(clue)
            remaining = narrowed
        if len(remaining) == 1:
            break
    # Drop clues the others make redundant, so every clue left is needed.
    for clue in list(clues):
        without = [c for c in clues if c is not clue]
        if len(solve(cast, without)) == 1:
            clues = without
    rng.shuffle(clues)
    answers = solve(cast, clues)
    if answers != [solution]:
        raise RuntimeError(f"puzzle {seed} does not have a unique solution: {answers}")
    return Puzzle(cast=cast, clues=tuple(clues), solution=solution, seed=seed)
