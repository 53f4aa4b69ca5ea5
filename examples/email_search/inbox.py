"""A seeded generator of small inboxes, and questions whose answer sits in exactly one email.

An inbox mixes emails that carry a fact (a flight's confirmation code, an order's tracking
number, a meeting room, an invoice amount, a reservation time) with newsletters and chatter.
Within one inbox each fact email has its own key (destination, order number, project,
vendor, restaurant) that no other email mentions, so a question names exactly one email.
"""

from __future__ import annotations

import datetime as dt
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass

PEOPLE = (
    "Alice Moreau",
    "Ben Okafor",
    "Chloe Tanaka",
    "Diego Alvarez",
    "Emma Schultz",
    "Farid Haddad",
    "Grace Lindqvist",
    "Hugo Bianchi",
)
CITIES = ("Lisbon", "Osaka", "Denver", "Nairobi", "Oslo", "Lima", "Hanoi", "Porto", "Quebec")
PROJECTS = ("Atlas", "Beacon", "Cobalt", "Delta", "Ember", "Falcon", "Granite", "Harbor")
VENDORS = (
    "Acme Supplies",
    "Brightline Print",
    "Cloudnine Hosting",
    "Dunmore Legal",
    "Evergreen Catering",
)
RESTAURANTS = ("La Perla", "The Copper Pot", "Sakura House", "Blue Fig", "Casa Verde", "Nordlys")
ROOMS = ("4B", "12A", "Orion", "Maple", "7C", "Juniper", "2F")
CARRIERS = ("UPS", "DHL", "FedEx")
NEWSLETTERS = (
    ("Weekly Digest", "Top stories this week: markets, weather and a new coffee place downtown."),
    ("Gym Club", "Spin classes move to the evening schedule next month."),
    ("Book Corner", "Three new mysteries arrived; members get ten percent off."),
    ("City Transit", "Line 3 runs a reduced service on Sunday for track works."),
    ("Garden Tips", "Water tomatoes in the morning and mulch against the heat."),
)
CHATTER = (
    ("Lunch?", "Are you free for lunch on Thursday? The usual place works for me."),
    ("Photos from the trip", "Finally sorted the photos, will share the album tonight."),
    ("Quick question", "Do you still have the charger I lent you? No rush."),
    ("Birthday plans", "Thinking of a small dinner on Saturday, let me know if you can come."),
)
START_DATE = dt.date(2024, 3, 1)


@dataclass(frozen=True)
class Email:
    id: str
    sender: str
    date: dt.date
    subject: str
    body: str

    def text(self) -> str:
        return f"From: {self.sender}\nDate: {self.date.isoformat()}\nSubject: {self.subject}\n\n{self.body}"


@dataclass(frozen=True)
class Question:
    """A question, its expected answer, the email holding it, and the key naming that email
    (a city, an order number...), which appears in that email's subject and no other."""

    text: str
    answer: str
    source_id: str
    key: str


@dataclass(frozen=True)
class SearchHit:
    id: str
    date: str
    sender: str
    subject: str
    snippet: str


_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


@dataclass(frozen=True)
class Inbox:
    emails: tuple[Email, ...]

    def read(self, email_id: str) -> Email | None:
        return next((email for email in self.emails if email.id == email_id), None)

    def search(self, keywords: list[str], *, limit: int = 5) -> list[SearchHit]:
        """Emails containing any keyword (sender, subject or body), most keywords first.

        Keywords match whole words, case-insensitively; a keyword of several words matches
        when all of them are present. Ties go to the newer email.
        """
        wanted = [_words(keyword) for keyword in keywords]
        scored = []
        for email in self.emails:
            words = _words(f"{email.sender} {email.subject} {email.body}")
            score = sum(1 for keyword in wanted if keyword and keyword <= words)
            if score:
                scored.append((score, email.date, email))
        scored.sort(key=lambda item: (item[0], item[1]), reverse=True)
        return [
            SearchHit(
                id=email.id,
                date=email.date.isoformat(),
                sender=email.sender,
                subject=email.subject,
                snippet=email.body[:80],
            )
            for _, _, email in scored[:limit]
        ]


def _code(
    rng: random.Random, length: int, alphabet: str = string.ascii_uppercase + string.digits
) -> str:
    return "".join(rng.choice(alphabet) for _ in range(length))


# A fact email: given a key nobody else in the inbox uses, the (sender, subject, body,
# question, answer) of the email.
FactTemplate = Callable[[random.Random, str, dt.date], tuple[str, str, str, str, str]]


def _later(rng: random.Random, sent: dt.date) -> dt.date:
    return sent + dt.timedelta(days=rng.randrange(2, 40))


def _flight(rng: random.Random, city: str, sent: dt.date) -> tuple[str, str, str, str, str]:
    code = _code(rng, 6, string.ascii_uppercase)
    flight = f"{_code(rng, 2, string.ascii_uppercase)}{rng.randrange(100, 1000)}"
    body = (
        f"Your booking is confirmed. Flight {flight} to {city} departs on "
        f"{_later(rng, sent).isoformat()} at "
        f"{rng.randrange(6, 22)}:{rng.choice(('05', '20', '45'))}. Confirmation code: {code}."
    )
    return (
        "SkyWays Airlines <bookings@skyways.example>",
        f"Your flight to {city}",
        body,
        f"What is the confirmation code of my flight to {city}?",
        code,
    )


def _order(rng: random.Random, order: str, sent: dt.date) -> tuple[str, str, str, str, str]:
    tracking = _code(rng, 10)
    carrier = rng.choice(CARRIERS)
    body = (
        f"Good news: order #{order} left our warehouse and travels with {carrier}. "
        f"Tracking number: {tracking}."
    )
    return (
        "ShopRight <orders@shopright.example>",
        f"Order #{order} has shipped",
        body,
        f"What is the tracking number of order #{order}?",
        tracking,
    )


def _meeting(rng: random.Random, project: str, sent: dt.date) -> tuple[str, str, str, str, str]:
    room = rng.choice(ROOMS)
    sender = rng.choice(PEOPLE)
    body = (
        f"Hi, let's review the {project} project on {_later(rng, sent).strftime('%A')} at "
        f"{rng.randrange(9, 17)}:00 in room {room}. Bring the latest numbers."
    )
    address = sender.split()[0].lower()
    return (
        f"{sender} <{address}@work.example>",
        f"{project} review",
        body,
        f"In which room is the {project} review meeting?",
        room,
    )


def _invoice(rng: random.Random, vendor: str, sent: dt.date) -> tuple[str, str, str, str, str]:
    amount = f"${rng.randrange(120, 5000)}.{rng.randrange(100):02d}"
    number = f"INV-{rng.randrange(10000, 99999)}"
    due = sent + dt.timedelta(days=30)
    body = f"Please find invoice {number} attached. Amount due: {amount}, payable by {due.isoformat()}."
    domain = vendor.split()[0].lower()
    return (
        f"{vendor} <billing@{domain}.example>",
        f"Invoice {number} from {vendor}",
        body,
        f"How much is the invoice from {vendor}?",
        amount,
    )


def _reservation(
    rng: random.Random, restaurant: str, sent: dt.date
) -> tuple[str, str, str, str, str]:
    time = f"{rng.randrange(6, 10)}:{rng.choice(('00', '15', '30', '45'))} pm"
    body = (
        f"Thank you for booking with {restaurant}. Your table for {rng.randrange(2, 7)} is "
        f"reserved on {_later(rng, sent).isoformat()} at {time}."
    )
    return (
        f"{restaurant} <reservations@{restaurant.lower().replace(' ', '')}.example>",
        f"Reservation at {restaurant}",
        body,
        f"At what time is my table at {restaurant}?",
        time,
    )


def _order_numbers(rng: random.Random) -> list[str]:
    # Six digits, so no five-digit invoice number can contain one.
    return [str(number) for number in rng.sample(range(100000, 1000000), 8)]


# (template, pool of keys): keys are drawn without replacement within an inbox.
FACT_KINDS: tuple[tuple[FactTemplate, Callable[[random.Random], list[str]]], ...] = (
    (_flight, lambda rng: list(CITIES)),
    (_order, _order_numbers),
    (_meeting, lambda rng: list(PROJECTS)),
    (_invoice, lambda rng: list(VENDORS)),
    (_reservation, lambda rng: list(RESTAURANTS)),
)


@dataclass(frozen=True)
class EmailScenario:
    inbox: Inbox
    question: Question
    seed: int


def check_inbox_size(size: int) -> None:
    if size < 2:
        raise ValueError(f"an inbox needs at least 2 emails, got {size}")


def generate_scenario(seed: int, *, size: int = 20, fact_share: float = 0.5) -> EmailScenario:
    """An inbox of ``size`` emails (about ``fact_share`` of them carrying facts) and one
    question about one of them; the same seed always gives the same inbox and question."""
    check_inbox_size(size)
    if not 0 < fact_share <= 1:
        raise ValueError(f"fact_share must be in (0, 1], got {fact_share}")
    rng = random.Random(seed)
    keys = {template: pool(rng) for template, pool in FACT_KINDS}
    for pool in keys.values():
        rng.shuffle(pool)
    dates = sorted(START_DATE + dt.timedelta(days=rng.randrange(90)) for _ in range(size))
    fact_positions = set(rng.sample(range(size), max(1, round(size * fact_share))))
    emails = []
    questions = []
    for index, sent in enumerate(dates):
        email_id = f"m{index:03d}"
        available = [template for template, pool in keys.items() if pool]
        if index in fact_positions and available:
            template = rng.choice(available)
            key = keys[template].pop()
            sender, subject, body, question, answer = template(rng, key, sent)
            questions.append(Question(question, answer, source_id=email_id, key=key))
        elif rng.random() < 0.5:
            name, body = rng.choice(NEWSLETTERS)
            sender = f"{name} <news@{name.lower().replace(' ', '')}.example>"
            subject = f"{name}: this week"
        else:
            person = rng.choice(PEOPLE)
            subject, body = rng.choice(CHATTER)
            sender = f"{person} <{person.split()[0].lower()}@mail.example>"
        emails.append(Email(id=email_id, sender=sender, date=sent, subject=subject, body=body))
    return EmailScenario(inbox=Inbox(tuple(emails)), question=rng.choice(questions), seed=seed)
