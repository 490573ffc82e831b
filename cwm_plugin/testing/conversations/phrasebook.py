"""Words and small talk for the generated conversations
(:mod:`cwm_plugin.testing.conversations.dialogues`).

Pools of names, places and things the planted facts are drawn from (each drawn once a conversation,
so a question has one answer; ``PEOPLE`` draws from ``WOMEN`` or ``MEN``); the reactions around
them; and small talk (``CHATS``: topics, as :mod:`cwm_plugin.testing.conversations.topics` describes
them, that plant no facts). None of it uses the words that mark a plan or a decision ("decided",
"signed up", "booked"): those belong to the topics that plant them.
"""

from __future__ import annotations

from cwm_plugin.testing.conversations.topics import OTHER, OWN, topic

WOMEN = [
    "Abena", "Aiko", "Alba", "Amara", "Anika", "Astrid", "Beatriz", "Bronwen", "Camille", "Dalia",
    "Deepa", "Dorota", "Elif", "Esme", "Farida", "Freya", "Greta", "Hana", "Ines", "Jovana",
    "Kalinda", "Laila", "Linnea", "Lucia", "Maren", "Marisol", "Mira", "Nadia", "Noor", "Odile",
    "Paloma", "Priya", "Rania", "Rosa", "Saanvi", "Selin", "Tamsin", "Thandi", "Ulla",
    "Valentina", "Wren", "Yara", "Zofia", "Zuri",
]
MEN = [
    "Anders", "Arjun", "Bastien", "Bilal", "Callum", "Chidi", "Cyrus", "Dario", "Declan", "Eamon",
    "Emeka", "Felix", "Gideon", "Hamid", "Henrik", "Ivo", "Jasper", "Kai", "Keanu", "Leon",
    "Lorenzo", "Magnus", "Mateo", "Nikolai", "Olu", "Oskar", "Quentin", "Rafael", "Rowan",
    "Soren", "Teodor", "Tobias", "Vikram", "Xavier", "Yusuf",
]
CITIES = [
    "Lisbon", "Porto", "Utrecht", "Ghent", "Bergen", "Krakow", "Valencia", "Seville", "Lyon",
    "Marseille", "Bologna", "Trieste", "Ljubljana", "Tallinn", "Riga", "Vilnius", "Gdansk",
    "Edinburgh", "Galway", "Cardiff", "Reykjavik", "Tromso", "Malmo", "Aarhus", "Hamburg",
    "Leipzig", "Salzburg", "Zagreb", "Split", "Thessaloniki", "Izmir", "Tbilisi", "Marrakesh",
    "Montreal", "Halifax", "Portland", "Savannah", "Oaxaca", "Cusco", "Valparaiso", "Hobart",
    "Wellington", "Kyoto", "Hanoi", "Penang",
]
NEIGHBOURHOODS = [
    "Alfama", "Westpark", "the Old Harbour", "Riverside", "Hillcrest", "Canal Row", "Northgate",
    "Elm Terrace", "the Mill Quarter", "Larkfield", "Brookside", "Saint Anne's", "Windmill Hill",
]
JOBS = ["data analyst", "nurse", "landscape architect", "primary school teacher", "sound engineer",
        "pharmacist", "structural engineer", "museum curator", "bakery manager", "physiotherapist",
        "translator", "urban planner", "veterinary nurse", "UX designer", "paramedic", "librarian",
        "marine biologist", "carpenter", "accountant", "radio producer", "chef", "social worker",
        "midwife", "tram driver", "beekeeper", "optician", "court reporter", "florist",
        "geologist", "speech therapist", "archivist", "electrician", "dietitian", "surveyor"]
COMPANIES = [
    "Northwind Logistics", "Bluefern Labs", "Harbourlight Studios", "Kestrel Analytics",
    "Greenhollow Farms", "Meridian Health", "Copperleaf Press", "Tidewater Energy",
    "Lanternworks", "Ashgrove Architects", "Silverline Transit", "Foxglove Games",
    "Brightwater Clinic", "Ironbark Construction", "Halcyon Travel", "Quillstone Publishing",
]
PROJECTS = ["harbour bridge", "winter catalogue", "clinic booking", "river clean-up",
            "school garden", "night bus", "archive scanning", "solar roof", "new menu",
            "flood barrier", "museum reopening", "library app", "wetland survey"]
RELATIVES = [  # a relation, its pronouns, and the pool its names come from
    {"rel": "sister", "they": "she", "them": "her", "names": "WOMEN"},
    {"rel": "brother", "they": "he", "them": "him", "names": "MEN"},
    {"rel": "cousin", "they": "she", "them": "her", "names": "WOMEN"},
    {"rel": "nephew", "they": "he", "them": "him", "names": "MEN"},
    {"rel": "niece", "they": "she", "them": "her", "names": "WOMEN"},
    {"rel": "dad", "they": "he", "them": "him", "names": "MEN"},
    {"rel": "mum", "they": "she", "them": "her", "names": "WOMEN"},
    {"rel": "grandfather", "they": "he", "them": "him", "names": "MEN"},
    {"rel": "daughter", "they": "she", "them": "her", "names": "WOMEN"},
    {"rel": "son", "they": "he", "them": "him", "names": "MEN"},
]
PET_KINDS = ["dog", "cat", "rabbit", "beagle", "tabby cat", "greyhound", "guinea pig",
             "border collie", "kitten", "puppy"]
PET_NAMES = [
    "Biscuit", "Pepper", "Mochi", "Juniper", "Waffles", "Pickle", "Hazel", "Ziggy", "Nacho",
    "Clementine", "Olive", "Tofu", "Bramble", "Maple", "Noodle", "Sprout", "Marble", "Figaro",
    "Basil", "Cosmo", "Pretzel", "Poppy", "Dumpling", "Nutmeg", "Otis", "Pumpkin", "Truffle",
]
TRICKS = ["ring a bell for treats", "fetch the post", "wave a paw", "roll over on command",
          "open the garden gate", "bring me my slippers", "jump through a hoop", "play dead",
          "spin in a circle", "sit at the kerb before crossing", "find a hidden sock",
          "push a ball back with its nose", "shake hands politely"]
INSTRUMENTS = ["cello", "violin", "trumpet", "piano", "clarinet", "drums", "ukulele", "flute",
               "double bass", "saxophone", "harp", "accordion"]
PIECES = ["a Chopin nocturne", "a Bach minuet", "a Vivaldi concerto", "a Debussy prelude",
          "a Gershwin song", "a Schubert serenade", "a Satie gymnopedie", "a Haydn sonata"]
VENUES = ["the Riverside Hall", "the Corn Exchange", "the Palm House", "the Old Chapel",
          "the Maritime Museum", "the Winter Garden", "the Union Theatre", "the Glasshouse"]
RACES = ["half marathon", "charity 10k", "trail race", "sprint triathlon", "cycling sportive",
         "open-water swim", "mountain relay", "night run"]
FINISH_TIMES = ["1 hour 52 minutes", "58 minutes", "2 hours 14 minutes", "47 minutes",
                "1 hour 31 minutes", "3 hours 5 minutes", "1 hour 9 minutes", "2 hours flat"]
BOOKS = [
    {"title": "The Glass Orchard", "author": "Imogen Vale"},
    {"title": "Salt and Ember", "author": "Tomas Arkwright"},
    {"title": "A Map of Quiet Rivers", "author": "Noemi Castell"},
    {"title": "The Lighthouse Ledger", "author": "Rupert Hale"},
    {"title": "Winter in Marrow Street", "author": "Ada Lindqvist"},
    {"title": "The Cartographer's Daughter", "author": "Lucius Penrose"},
    {"title": "Small Hours", "author": "Beatrix Onyango"},
    {"title": "Paper Kites", "author": "Hugo Marchetti"},
    {"title": "The Orchid Thief of Lyme", "author": "Celia Draycott"},
    {"title": "Nine Bells", "author": "Aurelio Santos"},
]
PLOTS = ["a family running a lighthouse during a long storm",
         "two sisters who inherit a failing vineyard", "a detective who is afraid of the dark",
         "a cook travelling along the Silk Road", "a village that forgets one word every winter",
         "an astronaut who writes letters home that never arrive",
         "a chess player hiding from her past", "a clockmaker who repairs a cursed watch",
         "three generations of beekeepers in the mountains",
         "a ferry captain who collects lost umbrellas", "a botanist mapping a drowned forest"]
CAFES = ["the Blue Kettle", "Larch and Loaf", "the Copper Pot", "Cafe Mirabel", "the Reading "
         "Room", "the Owl and Lantern", "the Tin Teapot", "Bean Street Kitchen"]
BAKES = ["lemon drizzle cake", "carrot cake", "chocolate babka", "plum tart", "cardamom buns",
         "apple strudel", "pistachio loaf", "coconut layer cake", "cinnamon rolls",
         "rhubarb crumble", "almond croissants", "ginger parkin", "blueberry cheesecake",
         "walnut brownies"]
INGREDIENTS = ["orange zest", "brown butter", "a pinch of black pepper", "grated ginger",
               "smoked salt", "espresso", "honey from the market", "a splash of rosewater",
               "toasted fennel seeds", "a spoon of miso", "dark rye flour", "lime leaves"]
PLANTS = ["sunflowers", "lavender", "tulips", "sweet peas", "dahlias", "runner beans",
          "foxgloves", "poppies", "climbing roses", "tomatoes", "hollyhocks", "marigolds",
          "snapdragons", "courgettes", "peonies", "cornflowers"]
COLOURS = ["yellow", "deep purple", "bright red", "pale pink", "orange", "sky blue",
           "forest green", "white", "burgundy", "teal"]
SUBJECTS = ["pottery", "Italian", "woodworking", "life drawing", "salsa", "Japanese",
            "photography", "creative writing", "bookbinding", "first aid", "astronomy",
            "stained glass", "watercolour", "jazz piano", "calligraphy", "upholstery",
            "sign language", "bread baking"]
SCHOOLS = ["the community college", "the adult learning centre", "the arts centre",
           "the library on Quay Street", "a little studio near the station"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
ORGS = ["the animal shelter", "the food bank", "the children's hospital", "the seed library",
        "the youth football club", "the refugee centre", "the community kitchen",
        "the city farm"]
VOLUNTEER_TASKS = ["walk the older dogs", "sort donations", "read stories to the kids",
                   "coach the under-tens", "cook lunch for forty people", "teach English",
                   "repair bikes", "look after the goats", "answer the helpline",
                   "plant trees along the canal", "drive patients to appointments"]
ART_SUBJECTS = ["a lake at sunrise", "my grandmother's kitchen", "the harbour in fog",
                "a field of wheat before a storm", "our street at night", "a fox in the snow",
                "the view from my balcony", "a heron on the riverbank",
                "the old lighthouse at dusk", "a market stall piled with lemons"]
GALLERIES = ["the Harbour Gallery", "the Mill Arts Centre", "the Lantern Gallery",
             "the town library foyer", "the Quayside Studios"]
VEHICLES = ["bicycle", "scooter", "camper van", "car", "cargo bike", "motorbike"]
VEHICLE_NAMES = ["Rocket", "Daisy", "Bluebell", "Thunder", "Marigold", "Comet", "Rusty"]
ALLERGENS = ["cats", "birch pollen", "peanuts", "shellfish", "dust mites", "penicillin",
             "kiwi fruit", "wasp stings"]
RESTAURANTS = ["Casa Lupa", "Little Saigon", "Tavola", "Mezze Garden", "Sakura Bar",
               "El Fogon", "Bistro Odette", "Spice Route"]
CUISINES = ["Portuguese", "Vietnamese", "Italian", "Lebanese", "Japanese", "Peruvian",
            "French", "Sri Lankan"]
STREETS = ["Quay Street", "Baker Lane", "Market Row", "Rose Avenue", "Mill Road",
           "Harbour Walk", "Chapel Street"]
DISHES = ["the grilled octopus", "the mushroom risotto", "the lamb tagine", "the duck ramen",
          "the fish tacos", "the aubergine curry", "the pork belly buns"]
BANDS = ["the Velvet Foxes", "Moonlit Harbour", "Paper Lanterns", "the Northern Lights",
         "Static Bloom", "Copper Canyon", "the Midnight Ferries"]
SONGS = ["a Motown classic", "an old Beatles song", "a Cuban son", "a Cape Verdean morna",
         "a Greek folk song", "an ABBA medley"]
TRIP_DOINGS = ["hiked up to the old fortress at sunrise", "took a cooking class in a market hall",
               "went kayaking along the coast", "spent a whole day in the botanical garden",
               "rode the funicular up the hill", "swam in a lake under the mountains",
               "followed a street-art tour through the old docks",
               "watched the sunset from the cathedral roof", "went to a night market",
               "took a boat to see the seals"]

STATES = ["busy but happy", "a bit tired", "really good", "all over the place",
          "surprisingly relaxed", "stressed out", "full of energy", "up and down"]
REACTIONS = ["Wow!", "That's amazing!", "Oh, how exciting!", "No way!", "That's wonderful news!",
             "I love that!", "How lovely!", "Good for you!", "That's so cool!", "Oh nice!",
             "That's brilliant!", "Aww, that's sweet!"]
SYMPATHY = ["That sounds tough.", "I'm sorry to hear that.", "Oh no, that's rough.",
            "That must be exhausting.", "Ugh, I know that feeling."]
WEATHER = ["grey and drizzly", "unexpectedly warm", "freezing", "windy enough to steal hats",
           "sunny but cold", "stormy", "muggy", "foggy every morning", "hailing on and off",
           "bright and crisp", "sticky and humid", "snowing sideways"]
WEEKEND_DOINGS = ["sorted out the cupboard under the stairs", "went to a flea market",
                  "made pancakes and read in bed", "walked along the river with a friend",
                  "painted the fence", "watched old films all afternoon",
                  "helped my parents in their garden", "tried a climbing wall for the first time",
                  "cleared out the garage", "went swimming in the outdoor pool",
                  "visited an antiques fair", "baked bread with my neighbour's kids",
                  "cycled to the next village for lunch", "repotted every plant in the flat",
                  "went to a pub quiz and came last", "took the ferry to the island"]
SHOW_TOPICS = ["a family of lighthouse keepers", "a cooking competition on a boat",
               "detectives in a mountain village", "a hospital in the 1950s",
               "a band touring small towns", "deep-sea creatures", "a heist at an opera house",
               "vets on a remote island", "a hotel run by ghosts", "rival florists in Paris",
               "the history of the printing press", "astronauts training in the desert"]
SUPPERS = ["a lentil soup", "a spinach pie", "a chickpea stew", "homemade dumplings",
           "a tomato and bread salad", "a mushroom stroganoff", "a pumpkin risotto",
           "fish pie with a crispy top", "a black bean chilli", "roast vegetables with halloumi",
           "a miso noodle broth", "stuffed peppers", "a leek and potato gratin"]

# Small talk: exchanges that plant no facts, about what friends catch up on between the news.
# They carry most of the conversations' vocabulary.
CHATS = [
    topic("weather", {"weather": "WEATHER"}, [
        (OWN, ["The weather here has been {weather} all week.",
               "Is it {weather} where you are too? It's been like that here for days."]),
        (OTHER, ["Same here, more or less. I keep carrying an umbrella I never open.",
                 "{sympathy} Here it changes every hour."]),
        (OWN, ["Ha, the umbrella is a lucky charm. The moment you leave it, it pours.",
               "Four seasons in a day. I've stopped checking the forecast."]),
    ], "{P} and {O} talked about the weather"),
    topic("weekend", {"doing": "WEEKEND_DOINGS", "doing2": "WEEKEND_DOINGS"}, [
        (OWN, ["This weekend I mostly {doing}. It was exactly what I needed.",
               "Quiet weekend: I {doing}."]),
        (OTHER, ["That sounds nice. I {doing2}, which was more tiring than it sounds.",
                 "{react} I just {doing2}."]),
        (OWN, ["Everything is more tiring than it sounds these days.",
               "Honestly, that sounds like a perfect weekend too."]),
    ], "{P} and {O} compared their weekends"),
    topic("work", {"state": "STATES"}, [
        (OWN, ["Work has been {state} lately. Too many meetings, not enough lunch breaks.",
               "Honestly, work is {state} at the moment. Everyone is stretched thin."]),
        (OTHER, ["{sympathy} Make sure you take some time for yourself.",
                 "{sympathy} Is it at least interesting?"]),
        (OWN, ["I'm trying. A long walk after dinner helps more than anything.",
               "Some days! And the people are kind, which counts for a lot."]),
        (OTHER, ["Walks fix most things. Or at least they make them smaller.",
                 "Kind people make the hard weeks bearable."]),
    ], "{P} talked about a busy time at work"),
    topic("show", {"show": "SHOW_TOPICS"}, [
        (OWN, ["Have you watched anything good lately? I'm hooked on a series about {show}.",
               "I can't stop watching this series about {show}."]),
        (OTHER, ["Ooh, I need something new. Is it funny or sad?", "{react} Is it any good?"]),
        (OWN, ["Both, somehow. Watch the first episode and tell me what you think.",
               "The first episode is slow, but then it's wonderful."]),
        (OTHER, ["I'll start it tonight with a big bowl of popcorn.",
                 "I'll give it until the third episode, that's my rule."]),
    ], "{P} recommended a series about {show}"),
    topic("supper", {"supper": "SUPPERS"}, [
        (OWN, ["I made {supper} last night from a recipe I found on a tin. Surprisingly good!",
               "New favourite dinner: {supper}. Cheap, quick and even better the next day."]),
        (OTHER, ["{react} Send me the recipe?", "I'm always looking for easy dinners. Yes!"]),
        (OWN, ["I'll write it down for you. The trick is lots of garlic.",
               "It takes twenty minutes, and there's only one pan to wash."]),
    ], "{P} shared a recipe for {supper}"),
    topic("sleep", {}, [
        (OWN, ["I've been sleeping terribly. The neighbours' new baby has strong lungs.",
               "I finally slept nine hours last night. I feel like a new person."]),
        (OTHER, ["{sympathy} Have you tried earplugs?", "{react} What's your secret?"]),
        (OWN, ["Two pairs at once. The baby wins anyway.",
               "No phone after ten, and a very boring book."]),
    ], "{P} talked about sleep"),
    topic("family-news", {"r": "RELATIVES"}, [
        (OWN, ["My {rel} {relname} called last night, we talked for two hours.",
               "I spent Sunday with my {rel} {relname}. We cooked and laughed all day."]),
        (OTHER, ["That's lovely. How is {relname} doing?", "{react} Sounds like a good day."]),
        (OWN, ["Busy as always, but {they} sounded happy.",
               "It was. We don't do it often enough."]),
    ], "{P} caught up with {relname}"),
    topic("power-cut", {}, [
        (OWN, ["We had a power cut on Tuesday evening, the whole street went dark for hours.",
               "The electricity went off in the middle of cooking yesterday. Half-baked bread!"]),
        (OTHER, ["Oh no! What did you do, candles and board games?",
                 "{sympathy} Did you rescue the bread in the end?"]),
        (OWN, ["Exactly that. My neighbours came over with a torch and a thermos of soup, it "
               "turned into a little party.", "We finished it on the barbecue. Smoky, but "
                                               "edible."]),
        (OTHER, ["Honestly, that sounds nicer than a normal Tuesday.",
                 "Barbecue bread could catch on."]),
    ], "{P} talked about a power cut"),
    topic("commute", {}, [
        (OWN, ["I've been cycling to work since the trains got so unreliable. My thighs hate "
               "me.", "The bus was forty minutes late again this morning. I read a whole "
                      "magazine at the stop."]),
        (OTHER, ["It gets easier after a few weeks. Trust me, the hills shrink.",
                 "{sympathy} At least you caught up on your reading."]),
        (OWN, ["I'll hold you to that. Right now every slope feels like a mountain.",
               "I now know everything about celebrity gardens. Useful knowledge."]),
    ], "{P} talked about the commute"),
    topic("dentist", {}, [
        (OWN, ["I finally went to the dentist after putting it off for two years.",
               "Had a filling this morning, and half my face is still numb."]),
        (OTHER, ["Brave! Was it as bad as you feared?", "{sympathy} Can you drink coffee?"]),
        (OWN, ["Not at all. One small filling and a lecture about flossing.",
               "Only through a straw, and very carefully."]),
    ], "{P} talked about a visit to the dentist"),
    topic("board-games", {}, [
        (OWN, ["We had a board game night on Friday. I lost at every single game.",
               "I bought a new card game about building railways. It's ridiculously "
               "competitive."]),
        (OTHER, ["Ha! Who won?", "{react} Can we play it next time I visit?"]),
        (OWN, ["My neighbour's twelve-year-old. She showed no mercy at all.",
               "Of course, but I warn you, friendships have ended over this game."]),
        (OTHER, ["The young ones are always the most ruthless.",
                 "I'm ready. I'll bring snacks as a peace offering."]),
    ], "{P} talked about a game night"),
    topic("market", {}, [
        (OWN, ["The farmers' market is back on Saturdays. I came home with far too many "
               "peaches.", "I found a tiny cheese stall at the market, run by an old couple "
                          "with goats."]),
        (OTHER, ["Too many peaches isn't a real problem. Make jam!",
                 "{react} Is the cheese any good?"]),
        (OWN, ["Jam is a wonderful idea. My grandmother's recipe, with a little lemon.",
               "Incredible. Soft, salty and a bit lemony."]),
    ], "{P} talked about the market"),
    topic("museum", {}, [
        (OWN, ["I spent a rainy afternoon at the natural history museum. The whale skeleton "
               "is enormous.", "There's a new exhibition of old maps at the museum. I stayed "
                              "until they closed."]),
        (OTHER, ["I haven't been since I was a child. Is the dinosaur hall still there?",
                 "Old maps are fascinating, all those sea monsters in the corners."]),
        (OWN, ["It is, and it's still the busiest room. Children everywhere, roaring.",
               "My favourite one had a mermaid drawn off the coast of Norway."]),
    ], "{P} talked about a museum visit"),
    topic("knitting", {}, [
        (OWN, ["I've started knitting again. My first scarf is lumpy, but it's warm.",
               "I'm learning to knit from videos. So far I've made one very long, very "
               "crooked scarf."]),
        (OTHER, ["Lumpy and warm is all a scarf needs to be.",
                 "Crooked is charming! What colour is it?"]),
        (OWN, ["That's what I keep telling myself. Next up: a hat.",
               "Mustard yellow, like a very long piece of toast."]),
    ], "{P} talked about knitting"),
    topic("podcast", {}, [
        (OWN, ["I'm listening to a podcast about the history of spices. Did you know pepper "
               "was once worth more than silver?", "I found a podcast where two old friends "
                                                  "read bad poetry aloud. I laugh on the bus."]),
        (OTHER, ["I didn't! Where do you find these?", "{react} Send me the name?"]),
        (OWN, ["Someone mentioned it at the library. I'm three episodes in and hooked.",
               "I'll message it to you later. Start with the one about the lighthouse."]),
    ], "{P} recommended a podcast"),
    topic("repairs", {}, [
        (OWN, ["The kitchen tap has been dripping for a week, and I finally fixed it myself.",
               "Our washing machine flooded the bathroom on Sunday. What a morning."]),
        (OTHER, ["{react} How did you learn to do that?", "{sympathy} Is the floor all right?"]),
        (OWN, ["A video and a lot of swearing. It only needed a new washer.",
               "Mostly. We used every towel in the flat to mop it up."]),
        (OTHER, ["You're more handy than you think.",
                 "At least your towels got a wash too, sort of."]),
    ], "{P} talked about fixing things at home"),
    topic("camping", {}, [
        (OWN, ["We went camping by the lake, and it rained the whole night.",
               "I slept in a tent for the first time in years. My back has opinions about it."]),
        (OTHER, ["Ha, camping isn't camping without a bit of rain.",
                 "{react} Was it at least a nice spot?"]),
        (OWN, ["True. The morning after was beautiful, with mist on the water.",
               "Gorgeous. We woke up to deer grazing right by the tent."]),
    ], "{P} talked about a camping trip"),
    topic("photos", {}, [
        (OWN, ["I've been taking photos of old doors around the city. Some of them are "
               "beautiful.", "I dug out my grandfather's film camera and shot a roll on a "
                             "walk."]),
        (OTHER, ["That's such a lovely project. Any favourites so far?",
                 "{react} Did the photos come out?"]),
        (OWN, ["A blue one with a brass lion knocker, near the old bakery.",
               "About half of them. The blurry ones have a certain mood, let's say."]),
    ], "{P} talked about photography"),
    topic("clean-up", {}, [
        (OWN, ["I joined a beach clean-up on Sunday. We filled forty bags in two hours.",
               "Our street organised a litter pick in the park. I met so many neighbours."]),
        (OTHER, ["{react} What was the strangest thing you found?",
                 "That's a nice way to meet people."]),
        (OWN, ["A rubber duck wearing sunglasses. It lives on my desk now.",
               "It really is. Someone brought cake for everyone afterwards."]),
    ], "{P} talked about a clean-up"),
    topic("cooking-fail", {}, [
        (OWN, ["I tried to make bread without a recipe. It came out as a brick.",
               "I burnt the rice so badly last night that the smoke alarm sang for us."]),
        (OTHER, ["Ha! Bricks have their uses. Doorstop?",
                 "Oh no. {sympathy} Dinner from the chip shop, then?"]),
        (OWN, ["It's holding the shed door open as we speak.",
               "Exactly that. It was delicious, to be honest."]),
    ], "{P} talked about a cooking disaster"),
    topic("birthday", {}, [
        (OWN, ["It was my birthday on Thursday. My friends surprised me with a picnic in the "
               "park.", "I turned another year older this week and celebrated with a very "
                       "quiet dinner."]),
        (OTHER, ["Happy birthday! I'm sorry I missed it.",
                 "Happy belated birthday! Quiet dinners are underrated."]),
        (OWN, ["Thank you! Next year you're coming, no excuses.",
               "They really are. Good food, good wine, and in bed by ten."]),
    ], "{P} talked about a birthday"),
]
