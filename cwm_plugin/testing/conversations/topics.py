"""What the people in the generated conversations talk about
(:mod:`cwm_plugin.testing.conversations.dialogues`).

A :class:`Topic` is a short exchange: lines said in turn by its owner and the other speaker, each
picked from a few wordings with ``{slot}`` fields. ``slots`` names the pool each field is drawn from
(:mod:`cwm_plugin.testing.conversations.phrasebook`; a pool of dicts fills several fields; a
relative also fills ``{relname}``, one name a relation of a person), or ``when``: a day relative to
the session (``past`` or ``future``), filling ``{when}`` with the words and ``{when_date}`` with the
day. ``{P}`` is the owner, ``{O}`` the other speaker; ``{react}`` and ``{sympathy}`` are drawn
afresh for every line. An exchange is told in one wording throughout: the k-th wording of every line
(the k-th modulo the line's count), so that a reply fits what it answers.

:data:`FACTS` plant facts; small talk (``CHATS`` in
:mod:`cwm_plugin.testing.conversations.phrasebook`) plants none. A topic that plants facts asks
:class:`Question` s about them, the evidence being its own lines (``0``, ``2``, ...) or, for a
follow-up (``later``, told in a later session), also the lines of the exchange it follows
(``"p0"``). ``after_when``: the follow-up waits until the day of ``{when}`` has passed (a race is
run after the day it is on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Question:
    category: int               # LoCoMo's: 1 multi-hop, 2 temporal, 4 single-hop
    text: str
    answer: str
    evidence: tuple[int | str, ...]


@dataclass(frozen=True)
class Topic:
    name: str
    lines: tuple[tuple[str, tuple[str, ...]], ...]    # (owner | other, wordings)
    summary: str
    slots: dict[str, str] = field(default_factory=dict)
    questions: tuple[Question, ...] = ()
    later: Topic | None = None
    after_when: bool = False


def topic(name: str, slots: dict[str, str], lines: Sequence[tuple[str, Sequence[str]]],
          summary: str, questions: Sequence[Question] = (), later: Topic | None = None,
          after_when: bool = False) -> Topic:
    """A :class:`Topic` written as lists (they read better in the tables below)."""
    return Topic(name, tuple((who, tuple(ws)) for who, ws in lines), summary, slots,
                 tuple(questions), later, after_when)


Q = Question
OWN, OTHER = "owner", "other"

FACTS = [
    topic("pet", {"kind": "PET_KINDS", "pet": "PET_NAMES", "when": "past"}, [
        (OWN, ["Big news: we adopted a {kind} from the shelter {when}, and we named it {pet}!",
               "I finally did it, I brought home a {kind} {when}. Meet {pet}, the new boss of "
               "the flat.",
               "So, there's a {kind} asleep on my feet right now. {pet} came home with us "
               "{when}."]),
        (OTHER, ["{react} How is {pet} settling in?",
                 "{react} Has {pet} taken over the sofa already?",
                 "Oh my goodness, a {kind}! Was it love at first sight with {pet}?"]),
        (OWN, ["The first night was all hiding under the bed, but now it follows me from room "
               "to room.",
               "Completely. It has a favourite corner by the window and a squeaky toy shaped "
               "like a carrot.",
               "It was! {pet} walked straight up to me at the shelter and wouldn't leave."]),
        (OTHER, ["Give it a week and it will think it owns the place.",
                 "Ha, the carrot toy! Our neighbours' {kind} has one just like it.",
                 "That's how you know. I'm so happy for you both."]),
        (OWN, ["It already does, honestly. I've never been so happy to be bossed around.",
               "I'll send you a video of the carrot squeaking at two in the morning.",
               "Thank you! The flat feels like a home now."]),
    ], "{P} adopted a {kind} named {pet}", [
        Q(4, "What is the name of {P}'s {kind}?", "{pet}", (0,)),
        Q(2, "When did {P} adopt {pet}?", "{when_date}", (0,)),
    ], later=topic("pet-trick", {"trick": "TRICKS"}, [
        (OTHER, ["How is {pet} doing these days?", "Is {pet} still hiding under the bed?"]),
        (OWN, ["{pet} is wonderful. I taught it to {trick}, and the neighbours love it.",
               "Not at all! {pet} learned to {trick} last week, I was so proud."]),
        (OTHER, ["Ha, clever {kind}! I'd pay to see that.",
                 "{react} You'll have to show me next time I visit."]),
        (OWN, ["It only works when there's cheese involved, to be fair.",
               "Deal. Bring treats and it will perform all evening."]),
    ], "{P} taught {pet} to {trick}", [
        Q(4, "What did {P} teach {pet} to do?", "{trick}", (1,)),
        Q(1, "What trick did {P}'s {kind} learn?", "{trick}", ("p0", 1)),
    ])),
    topic("instrument", {"r": "RELATIVES", "instrument": "INSTRUMENTS",
                      "when": "past"}, [
        (OWN, ["My {rel} {relname} started {instrument} lessons {when}, and {they} practises "
               "every evening.",
               "Guess what, my {rel} {relname} picked up the {instrument} {when}. The house is "
               "full of music now."]),
        (OTHER, ["{react} Is {relname} any good yet?",
                 "That's lovely. Did {relname} choose the {instrument} all by {them}self?"]),
        (OWN, ["Getting there! The teacher says {relname} has a good ear, and {they} never "
               "skips practice.",
               "Yes, {they} heard it at a concert in the park and talked about nothing else for "
               "a month."]),
        (OTHER, ["I tried the recorder at school and gave up after a week, so I'm impressed.",
                 "That's the best way to start, when it comes from {them}."]),
        (OWN, ["Same here, so I'm a bit jealous, to be honest.",
               "Exactly. Nobody has to remind {them} to practise."]),
    ], "{P}'s {rel} {relname} is learning the {instrument}", [
        Q(4, "What instrument is {P}'s {rel} learning?", "{instrument}", (0,)),
        Q(2, "When did {relname} start {instrument} lessons?", "{when_date}", (0,)),
    ], later=topic("recital", {"piece": "PIECES", "venue": "VENUES", "when": "past"}, [
        (OTHER, ["Is {relname} still playing the {instrument}?",
                 "How are the {instrument} lessons going for {relname}?"]),
        (OWN, ["Yes! {relname} played {piece} at a recital in {venue} {when}.",
               "Better than ever: {when} {relname} played {piece} in {venue}, in front of "
               "about a hundred people."]),
        (OTHER, ["{react} Tell {relname} I said well done.",
                 "{react} Were you nervous for {them}?"]),
        (OWN, ["I will. {relname} was beaming for the rest of the day.",
               "More than {they} was! I couldn't sit still."]),
    ], "{P} told {O} that {relname} played {piece} at {venue}", [
        Q(4, "Where did {relname} play a recital?", "{venue}", (1,)),
        Q(1, "Which piece did {P}'s {rel} play at the recital?", "{piece}", ("p0", 1)),
        Q(2, "When did {relname} play at {venue}?", "{when_date}", (1,)),
    ])),
    topic("race", {"race": "RACES", "city": "CITIES", "when": "future"}, [
        (OWN, ["I signed up for the {race} in {city}. It's {when}, so I have to train properly.",
               "So I signed up for a {race} in {city}, {when}. What was I thinking?"]),
        (OTHER, ["{react} How much are you training at the moment?",
                 "{react} Do you have a training plan?"]),
        (OWN, ["Three times a week, with a long one on Sunday mornings along the river.",
               "A friend wrote me one. Mostly it says: go slower than you want to."]),
        (OTHER, ["Sunday mornings by the river sound lovely, at least.",
                 "That sounds like good advice for life in general."]),
        (OWN, ["They are, apart from the geese. The geese are not friendly.",
               "Ha, true. I'm terrible at following it in both."]),
    ], "{P} signed up for the {race} in {city}", [
        Q(2, "When is {P}'s {race}?", "{when_date}", (0,)),
        Q(4, "Where is the {race} that {P} signed up for?", "{city}", (0,)),
    ], later=topic("race-done", {"finish": "FINISH_TIMES"}, [
        (OTHER, ["How did the {race} go?", "So, did you survive the {race} in {city}?"]),
        (OWN, ["I finished in {finish}! My legs hurt for days, but I'd do it again.",
               "Just about: {finish}, and I smiled in every photo. The last hill nearly killed "
               "me."]),
        (OTHER, ["{react} You should be really proud.", "{react} Any plans for the next one?"]),
    ], "{P} finished the {race} in {finish}", [
        Q(4, "How long did {P} take to finish the {race}?", "{finish}", (1,)),
        Q(1, "What was {P}'s time in the race in {city}?", "{finish}", ("p0", 1)),
    ]), after_when=True),
    topic("book", {"b": "BOOKS", "plot": "PLOTS"}, [
        (OWN, ["I just finished reading {title} by {author}. I couldn't put it down.",
               "Have you read {title}? {author} wrote it, and I read it in two nights."]),
        (OTHER, ["I haven't heard of it. What is it about?", "{react} What's it about?"]),
        (OWN, ["It's about {plot}. The ending made me cry on the bus.",
               "It follows {plot}. Quiet, but it stays with you."]),
        (OTHER, ["Crying on the bus is the sign of a good book. Can I borrow it?",
                 "I love books like that. I'll look for it at the library."]),
        (OWN, ["Of course, as long as you give it back this time!",
               "Do! Tell me what you think of the last chapter."]),
    ], "{P} recommended {title} by {author}", [
        Q(4, "Which book by {author} did {P} read?", "{title}", (0,)),
        Q(4, "Who wrote the book {P} could not put down?", "{author}", (0,)),
    ], later=topic("book-club", {"cafe": "CAFES"}, [
        (OWN, ["I started a book club at {cafe}, and our first pick was {title}!",
               "Remember {title}? It's the first book of the club I started at {cafe}."]),
        (OTHER, ["{react} How many people came?", "{react} Can anyone join?"]),
        (OWN, ["Seven, and we talked for three hours. Mostly about the ending.",
               "Anyone at all. We meet on the first Thursday of the month."]),
    ], "{P} started a book club at {cafe}", [
        Q(4, "Where did {P} start a book club?", "{cafe}", (0,)),
        Q(1, "Who wrote the first book of {P}'s book club?", "{author}", ("p0", 0)),
    ])),
    topic("job", {"job": "JOBS", "company": "COMPANIES", "when": "past"}, [
        (OWN, ["I have news: I took a job as a {job} at {company}, and I started {when}.",
               "New chapter for me! I'm a {job} at {company} now, I started {when}."]),
        (OTHER, ["{react} How are your new colleagues?",
                 "Congratulations! What do you do there all day?"]),
        (OWN, ["Everyone is friendly, and my desk looks out over the water.",
               "A bit of everything so far. It's a lot to learn, but I go home tired in a good "
               "way."]),
        (OTHER, ["A desk with a view! I stare at a car park all day.",
                 "That's the best kind of tired. I'm really happy for you."]),
        (OWN, ["You should come for lunch one day and see it.",
               "Thanks. It feels like the right move at the right time."]),
    ], "{P} started working as a {job} at {company}", [
        Q(4, "Where does {P} work now?", "{company}", (0,)),
        Q(4, "What job did {P} take at {company}?", "{job}", (0,)),
        Q(2, "When did {P} start at {company}?", "{when_date}", (0,)),
    ], later=topic("job-project", {"boss": "PEOPLE", "project": "PROJECTS"}, [
        (OTHER, ["How is the job at {company} going?", "Still happy at {company}?"]),
        (OWN, ["Really well. My manager {boss} put me in charge of the {project} project.",
               "Yes! {boss}, my manager, gave me the {project} project to run."]),
        (OTHER, ["{react} That's a lot of trust so soon.", "{react} Is it a big one?"]),
        (OWN, ["I know, I'm trying not to let it go to my head.",
               "Big enough that I dream about spreadsheets."]),
    ], "{P} leads the {project} project for {boss}", [
        Q(4, "Who is {P}'s manager?", "{boss}", (1,)),
        Q(1, "Which project does {P} run at the place where {P} works as a {job}?",
          "the {project} project", ("p0", 1)),
    ])),
    topic("trip", {"city": "CITIES", "when": "future"}, [
        (OWN, ["We booked a trip to {city} {when}! I've wanted to go for years.",
               "Guess where we're off to {when}? {city}! The tickets are booked."]),
        (OTHER, ["{react} What do you want to see there?", "{react} Who's going with you?"]),
        (OWN, ["Mostly the markets and the old town, and I want to eat everything.",
               "Just the two of us, no plans beyond good food and long walks."]),
        (OTHER, ["Bring me back something from the markets, anything at all.",
                 "That's the best kind of holiday. No alarms allowed."]),
    ], "{P} booked a trip to {city}", [
        Q(4, "Which city did {P} book a trip to?", "{city}", (0,)),
        Q(2, "When is {P}'s trip to {city}?", "{when_date}", (0,)),
    ], later=topic("trip-done", {"doing": "TRIP_DOINGS"}, [
        (OTHER, ["How was {city}?", "You're back from {city}! How was it?"]),
        (OWN, ["Amazing. We {doing}, and I'd go back tomorrow.",
               "Even better than I hoped. We {doing}."]),
        (OTHER, ["I'm so jealous. Send me the photos!", "{react} That sounds unforgettable."]),
    ], "{P} said that in {city} they {doing}", [
        Q(4, "What did {P} do in {city}?", "{doing}", (1,)),
    ]), after_when=True),
    topic("bake", {"bake": "BAKES", "r": "RELATIVES",
                "secret": "INGREDIENTS", "when": "past"}, [
        (OWN, ["I baked a {bake} for my {rel} {relname}'s birthday {when}, with my "
               "grandmother's recipe.",
               "For {relname}'s birthday {when} I made a {bake}, the one my grandmother taught "
               "me. My {rel} had three slices."]),
        (OTHER, ["{react} What's the secret?", "That sounds delicious. Any secret ingredient?"]),
        (OWN, ["{secret}. Nobody ever guesses it.", "It's {secret}, but don't tell anyone."]),
        (OTHER, ["My lips are sealed. Save me a slice next time?",
                 "I would never have guessed. I need to try that."]),
    ], "{P} baked a {bake} for {relname}'s birthday", [
        Q(4, "What did {P} bake for {relname}'s birthday?", "{bake}", (0,)),
        Q(4, "What is the secret ingredient in {P}'s {bake}?", "{secret}", (2,)),
        Q(2, "When was {relname}'s birthday?", "{when_date}", (0,)),
    ]),
    topic("garden", {"plant": "PLANTS", "when": "past"}, [
        (OWN, ["I planted {plant} along the back fence {when}. My hands are still covered in "
               "soil.", "{when} I finally put {plant} in along the fence."]),
        (OTHER, ["{react} Do they need a lot of sun?", "{react} Is the soil any good there?"]),
        (OWN, ["Half a day of sun is enough. The snails are my real enemy.",
               "It's heavy clay, so I dug in a lot of compost first."]),
        (OTHER, ["My mother puts crushed eggshells around hers. It seems to work.",
                 "Hard work, but it will pay off in a few months."]),
    ], "{P} planted {plant} in the garden", [
        Q(4, "What did {P} plant along the fence?", "{plant}", (0,)),
    ], later=topic("garden-bloom", {"colour": "COLOURS"}, [
        (OTHER, ["Did your {plant} come up?", "How are the {plant} by the fence?"]),
        (OWN, ["They're out, {colour} everywhere! I picked a bunch for the kitchen table.",
               "Look at this: {colour} from one end of the fence to the other."]),
        (OTHER, ["{react} All that digging was worth it.", "{react} What a colour."]),
    ], "{P}'s {plant} came out {colour}", [
        Q(1, "What colour are the flowers {P} planted along the fence?", "{colour}",
          ("p0", 1)),
    ])),
    topic("class", {"subject": "SUBJECTS", "school": "SCHOOLS", "day": "WEEKDAYS",
                 "teacher": "PEOPLE"}, [
        (OWN, ["I enrolled in a {subject} class at {school}. It's on {day} evenings.",
               "On {day} evenings I'm at {school} now: I enrolled in {subject}!"]),
        (OTHER, ["{react} What made you choose {subject}?", "{react} How's the teacher?"]),
        (OWN, ["I always wanted to try, and the teacher, {teacher}, is brilliant.",
               "{teacher}, the teacher, makes it feel easy even when it isn't."]),
        (OTHER, ["A good teacher makes all the difference.",
                 "I'd love to try something like that. Is the group nice?"]),
        (OWN, ["It really does. I look forward to it all week.",
               "Lovely people, and there's tea and biscuits halfway through."]),
    ], "{P} takes a {subject} class with {teacher}", [
        Q(4, "What class did {P} enroll in?", "{subject}", (0,)),
        Q(4, "Who teaches {P}'s {subject} class?", "{teacher}", (2,)),
        Q(4, "On which evening is {P}'s {subject} class?", "{day}", (0,)),
    ]),
    topic("volunteer", {"org": "ORGS", "day": "WEEKDAYS", "task": "VOLUNTEER_TASKS",
                     "neighbour": "PEOPLE"}, [
        (OWN, ["I volunteer at {org} every {day} now. I {task}.",
               "Every {day} I'm at {org}: I {task}, and it's the best part of my week."]),
        (OTHER, ["{react} How did you find out about it?", "{react} How did that start?"]),
        (OWN, ["My neighbour {neighbour} has helped there for years and brought me along.",
               "{neighbour} from next door asked me to come once, and I stayed."]),
        (OTHER, ["That's really kind of you both. I should do something like that.",
                 "Good neighbours are worth a lot."]),
    ], "{P} volunteers at {org}", [
        Q(4, "Where does {P} volunteer?", "{org}", (0,)),
        Q(4, "Which neighbour brought {P} to {org}?", "{neighbour}", (2,)),
        Q(4, "What does {P} do at {org}?", "{task}", (0,)),
    ]),
    topic("move", {"area": "NEIGHBOURHOODS"}, [
        (OWN, ["We decided to move to a flat in {area}. It's smaller, but the light is "
               "wonderful.", "After months of viewings we decided on a place in {area}!"]),
        (OTHER, ["{react} When is the move?", "{react} Will you miss the old place?"]),
        (OWN, ["At the end of next month, so the living room is already full of boxes.",
               "A little, but not the stairs. The new building has a lift!"]),
        (OTHER, ["Call me when you need help carrying things.",
                 "A lift! You'll never want to leave."]),
    ], "{P} decided to move to {area}", [
        Q(4, "Where did {P} decide to move?", "{area}", (0,)),
    ], later=topic("moved", {"colour": "COLOURS"}, [
        (OWN, ["The move to {area} is done! We painted the kitchen {colour} and unpacked the "
               "last box.", "We're in! The new kitchen in {area} is {colour} now."]),
        (OTHER, ["{react} I need to see it.", "{react} Housewarming party?"]),
        (OWN, ["Come by any evening, the kettle is always on.",
               "Absolutely, as soon as we find the box with the glasses."]),
    ], "{P} painted the new kitchen in {area} {colour}", [
        Q(1, "What colour is the kitchen of {P}'s new flat?", "{colour}", ("p0", 0)),
    ])),
    topic("art", {"art": "ART_SUBJECTS", "gallery": "GALLERIES"}, [
        (OWN, ["I finished a painting of {art}, and {gallery} will show it next month!",
               "Remember the painting of {art}? It will hang in {gallery} for the spring "
               "show."]),
        (OTHER, ["{react} Can I come to the opening?", "{react} How did that happen?"]),
        (OWN, ["Of course, I'll send you the invitation.",
               "The curator saw it online. I still can't believe it."]),
        (OTHER, ["I'll wear something fancy and pretend I know about art.",
                 "Believe it! You've worked on your painting for years."]),
    ], "{P}'s painting of {art} is shown at {gallery}", [
        Q(4, "What did {P} paint?", "{art}", (0,)),
        Q(4, "Where will {P}'s painting be shown?", "{gallery}", (0,)),
    ]),
    topic("vehicle", {"colour": "COLOURS", "vehicle": "VEHICLES", "vname": "VEHICLE_NAMES",
                   "when": "past"}, [
        (OWN, ["I bought a second-hand {colour} {vehicle} {when}. I named it {vname}, don't "
               "laugh.", "Meet {vname}: the {colour} {vehicle} I bought {when}."]),
        (OTHER, ["Ha, {vname} is a great name! Does it run well?",
                 "{react} Where will you take it first?"]),
        (OWN, ["It squeaks on every corner, but it's mine.",
               "To the coast, the moment the weather turns."]),
    ], "{P} bought a {colour} {vehicle} called {vname}", [
        Q(4, "What colour is {P}'s {vehicle}?", "{colour}", (0,)),
        Q(4, "What did {P} name the {vehicle}?", "{vname}", (0,)),
        Q(2, "When did {P} buy the {vehicle}?", "{when_date}", (0,)),
    ]),
    topic("wedding", {"friend": "PEOPLE", "city": "CITIES", "when": "future"}, [
        (OWN, ["My old friend {friend} is getting married in {city} {when}, and I'm giving a "
               "speech!",
               "{friend} asked me to give a speech at the wedding in {city}, {when}."]),
        (OTHER, ["{react} Are you nervous about the speech?", "{react} Is it a big wedding?"]),
        (OWN, ["Terrified. I've written four versions already.",
               "About a hundred guests, in a garden by the water."]),
        (OTHER, ["Read it to me some time, I'll be an honest audience.",
                 "That sounds like a dream. I hope the weather is kind."]),
    ], "{P} is giving a speech at {friend}'s wedding in {city}", [
        Q(2, "When is {friend}'s wedding?", "{when_date}", (0,)),
        Q(4, "Where is {friend} getting married?", "{city}", (0,)),
    ], later=topic("wedding-done", {"song": "SONGS"}, [
        (OTHER, ["How was {friend}'s wedding?", "How did the speech go at {friend}'s wedding?"]),
        (OWN, ["Beautiful! The speech went fine, and {friend} danced to {song} all night.",
               "People laughed in the right places! The first dance was {song}."]),
        (OTHER, ["{react} I'm so glad it went well.", "{react} I wish I'd been there."]),
    ], "{P} said the first dance at {friend}'s wedding was {song}", [
        Q(4, "What did {friend} dance to at the wedding?", "{song}", (1,)),
    ]), after_when=True),
    topic("allergy", {"allergen": "ALLERGENS"}, [
        (OWN, ["The doctor finally found why I've been so unwell: I'm allergic to {allergen}.",
               "Test results are in. Allergic to {allergen}, of all things."]),
        (OTHER, ["Oh no. {sympathy} Will you have to change a lot?",
                 "{sympathy} Did you suspect it?"]),
        (OWN, ["Mostly reading labels carefully. At least now I know.",
               "Not at all, which is why it took so long."]),
        (OTHER, ["Knowing is half the battle. Look after yourself.",
                 "Well, at least the mystery is solved."]),
    ], "{P} found out about an allergy to {allergen}", [
        Q(4, "What is {P} allergic to?", "{allergen}", (0,)),
    ]),
    topic("restaurant", {"rest": "RESTAURANTS", "cuisine": "CUISINES", "street": "STREETS",
                      "dish": "DISHES"}, [
        (OWN, ["We found a new favourite place: {rest}, a little {cuisine} restaurant on "
               "{street}.", "Have you been to {rest} on {street}? Best {cuisine} food in town."]),
        (OTHER, ["{react} What should I order there?", "Not yet! What's good?"]),
        (OWN, ["{dish}, no question. I dream about it.", "Get {dish}. Trust me."]),
        (OTHER, ["Noted. I'll go this weekend and report back.",
                 "You had me at the first bite. I'm hungry now."]),
    ], "{P} recommended {rest} on {street}", [
        Q(4, "What kind of food does {rest} serve?", "{cuisine}", (0,)),
        Q(4, "Which street is {rest} on?", "{street}", (0,)),
        Q(1, "What dish does {P} recommend at the {cuisine} restaurant on {street}?",
          "{dish}", (0, 2)),
    ]),
    topic("concert", {"band": "BANDS", "venue": "VENUES", "when": "past"}, [
        (OWN, ["I saw {band} live at {venue} {when}. Best concert of my life.",
               "{when} we went to see {band} at {venue}. I still have no voice."]),
        (OTHER, ["{react} Did they play the old songs?", "{react} Was it packed?"]),
        (OWN, ["All of them, and an encore that went on for half an hour.",
               "Completely, we were squashed against the barrier all night."]),
        (OTHER, ["I've been listening to them since school. I'm so jealous.",
                 "Worth the bruises, I hope!"]),
    ], "{P} saw {band} at {venue}", [
        Q(4, "Which band did {P} see at {venue}?", "{band}", (0,)),
        Q(2, "When did {P} see {band} live?", "{when_date}", (0,)),
    ]),
]
