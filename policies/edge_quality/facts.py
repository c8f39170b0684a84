"""Well-known facts for the lookup family: (question subject, answer, accepted aliases).

Each table row is one fact; the probe generator words the question from its family's templates.
Answers are matched as whole words after accent folding (checkers.py), so aliases list only
real alternative spellings, never looser answers.
"""

from __future__ import annotations

# (country, capital, *aliases): city-states and countries whose capital shares their name are left out,
# because restating the question would then pass as an answer.
CAPITALS: tuple[tuple[str, ...], ...] = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("the United Kingdom", "London"), ("Ireland", "Dublin"), ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"),
    ("Austria", "Vienna"), ("Switzerland", "Bern", "Berne"), ("Poland", "Warsaw"), ("Czechia", "Prague"),
    ("Hungary", "Budapest"), ("Greece", "Athens"), ("Sweden", "Stockholm"), ("Norway", "Oslo"),
    ("Denmark", "Copenhagen"), ("Finland", "Helsinki"), ("Iceland", "Reykjavik"), ("Russia", "Moscow"),
    ("Ukraine", "Kyiv", "Kiev"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"), ("Turkey", "Ankara"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Nigeria", "Abuja"),
    ("Ethiopia", "Addis Ababa"), ("Morocco", "Rabat"), ("South Africa", "Pretoria"), ("Ghana", "Accra"),
    ("Senegal", "Dakar"), ("Tanzania", "Dodoma"), ("Uganda", "Kampala"), ("Zimbabwe", "Harare"),
    ("Japan", "Tokyo"), ("China", "Beijing", "Peking"), ("India", "New Delhi"), ("South Korea", "Seoul"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"), ("the Philippines", "Manila"),
    ("Malaysia", "Kuala Lumpur"), ("Pakistan", "Islamabad"), ("Bangladesh", "Dhaka"), ("Nepal", "Kathmandu"),
    ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Saudi Arabia", "Riyadh"), ("Israel", "Jerusalem"),
    ("Afghanistan", "Kabul"), ("Syria", "Damascus"), ("Lebanon", "Beirut"), ("Jordan", "Amman"),
    ("the United States", "Washington", "Washington, D.C.", "Washington DC"), ("Canada", "Ottawa"),
    ("Mexico", "Mexico City"), ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"), ("Chile", "Santiago"),
    ("Peru", "Lima"), ("Colombia", "Bogota"), ("Venezuela", "Caracas"), ("Cuba", "Havana"),
    ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Mongolia", "Ulaanbaatar", "Ulan Bator"),
    ("Slovakia", "Bratislava"), ("Slovenia", "Ljubljana"), ("Estonia", "Tallinn"), ("Latvia", "Riga"),
    ("Lithuania", "Vilnius"), ("Belarus", "Minsk"), ("Georgia", "Tbilisi"), ("Armenia", "Yerevan"),
    ("Azerbaijan", "Baku"), ("Kazakhstan", "Astana"), ("Uzbekistan", "Tashkent"), ("Sri Lanka", "Colombo", "Sri Jayawardenepura Kotte"),
    ("Myanmar", "Naypyidaw", "Nay Pyi Taw"), ("Cambodia", "Phnom Penh"), ("Laos", "Vientiane"), ("Ecuador", "Quito"),
    ("Bolivia", "Sucre", "La Paz"), ("Uruguay", "Montevideo"), ("Paraguay", "Asuncion"), ("Jamaica", "Kingston"),
    ("Algeria", "Algiers"), ("Tunisia", "Tunis"), ("Libya", "Tripoli"),
    ("Sudan", "Khartoum"), ("Angola", "Luanda"), ("Zambia", "Lusaka"), ("Mozambique", "Maputo"),
    ("Madagascar", "Antananarivo"), ("Cameroon", "Yaounde"), ("Mali", "Bamako"), ("Qatar", "Doha"),
)

# (element, symbol)
SYMBOLS: tuple[tuple[str, ...], ...] = (
    ("hydrogen", "H"), ("helium", "He"), ("carbon", "C"), ("nitrogen", "N"), ("oxygen", "O"), ("sodium", "Na"),
    ("magnesium", "Mg"), ("aluminium", "Al"), ("silicon", "Si"), ("phosphorus", "P"), ("sulfur", "S"),
    ("chlorine", "Cl"), ("potassium", "K"), ("calcium", "Ca"), ("iron", "Fe"), ("copper", "Cu"), ("zinc", "Zn"),
    ("silver", "Ag"), ("gold", "Au"), ("mercury", "Hg"), ("lead", "Pb"), ("tin", "Sn"), ("uranium", "U"),
    ("neon", "Ne"), ("argon", "Ar"), ("lithium", "Li"), ("fluorine", "F"), ("nickel", "Ni"), ("platinum", "Pt"),
    ("iodine", "I"),
)

# (work, author, *aliases)
AUTHORS: tuple[tuple[str, ...], ...] = (
    ("Romeo and Juliet", "Shakespeare"), ("Hamlet", "Shakespeare"), ("Macbeth", "Shakespeare"),
    ("Pride and Prejudice", "Austen"), ("Emma", "Austen"), ("1984", "Orwell"), ("Animal Farm", "Orwell"),
    ("War and Peace", "Tolstoy"), ("Anna Karenina", "Tolstoy"), ("Crime and Punishment", "Dostoevsky", "Dostoyevsky"),
    ("The Odyssey", "Homer"), ("The Iliad", "Homer"), ("Don Quixote", "Cervantes"), ("Moby-Dick", "Melville"),
    ("Oliver Twist", "Dickens"), ("A Christmas Carol", "Dickens"), ("Great Expectations", "Dickens"),
    ("The Divine Comedy", "Dante"), ("Frankenstein", "Mary Shelley"), ("Dracula", "Stoker"),
    ("The Adventures of Tom Sawyer", "Twain"), ("Adventures of Huckleberry Finn", "Twain"),
    ("The Old Man and the Sea", "Hemingway"), ("The Great Gatsby", "Fitzgerald"), ("Ulysses", "Joyce"),
    ("Les Miserables", "Victor Hugo"), ("The Hobbit", "Tolkien"), ("The Lord of the Rings", "Tolkien"),
    ("Harry Potter and the Philosopher's Stone", "Rowling"), ("Jane Eyre", "Charlotte Bronte"),
    ("Wuthering Heights", "Emily Bronte"), ("The Origin of Species", "Darwin"), ("Faust", "Goethe"),
    ("The Metamorphosis", "Kafka"), ("One Hundred Years of Solitude", "Garcia Marquez", "Marquez"),
    ("To Kill a Mockingbird", "Harper Lee"), ("Alice's Adventures in Wonderland", "Lewis Carroll", "Carroll"),
    ("The Raven", "Poe"), ("Gulliver's Travels", "Swift"), ("Robinson Crusoe", "Defoe"),
)

# (country, currency, *aliases)
CURRENCIES: tuple[tuple[str, ...], ...] = (
    ("Japan", "yen"), ("the United Kingdom", "pound", "pound sterling", "sterling"), ("the United States", "dollar"),
    ("India", "rupee"), ("China", "yuan", "renminbi"), ("Russia", "ruble", "rouble"), ("Mexico", "peso"),
    ("Brazil", "real"), ("Switzerland", "franc"), ("South Korea", "won"), ("Germany", "euro"), ("France", "euro"),
    ("Italy", "euro"), ("Spain", "euro"), ("Canada", "dollar"), ("Australia", "dollar"), ("Sweden", "krona"),
    ("Norway", "krone"), ("Denmark", "krone"), ("Poland", "zloty"), ("Turkey", "lira"), ("South Africa", "rand"),
    ("Thailand", "baht"), ("Israel", "shekel"), ("Vietnam", "dong"), ("Indonesia", "rupiah"), ("Egypt", "pound"),
    ("Argentina", "peso"), ("Saudi Arabia", "riyal"), ("Hungary", "forint"),
)

# (word, opposite, *aliases)
OPPOSITES: tuple[tuple[str, ...], ...] = (
    ("hot", "cold"), ("big", "small", "little"), ("up", "down"), ("day", "night"), ("fast", "slow"),
    ("happy", "sad", "unhappy"), ("light", "dark", "heavy"), ("open", "closed", "shut", "close"), ("early", "late"),
    ("young", "old"), ("tall", "short"), ("wet", "dry"), ("full", "empty"), ("rich", "poor"), ("strong", "weak"),
    ("hard", "soft", "easy"), ("high", "low"), ("win", "lose"), ("true", "false"), ("above", "below"),
    ("begin", "end", "finish"), ("buy", "sell"), ("push", "pull"), ("inside", "outside"), ("left", "right"),
    ("north", "south"), ("east", "west"), ("black", "white"), ("love", "hate"), ("good", "bad", "evil"),
    ("clean", "dirty"), ("thick", "thin"), ("loud", "quiet", "soft"), ("first", "last"), ("always", "never"),
    ("question", "answer"), ("alive", "dead"), ("friend", "enemy", "foe"), ("arrive", "leave", "depart"),
    ("remember", "forget"),
)

# (question, answer, *aliases): numbers are matched as numbers, words as whole words
GENERAL: tuple[tuple[str, ...], ...] = (
    ("How many legs does a spider have?", "8", "eight"), ("How many legs does an insect have?", "6", "six"),
    ("How many days are there in a week?", "7", "seven"), ("How many months are there in a year?", "12", "twelve"),
    ("How many hours are there in a day?", "24", "twenty-four"), ("How many minutes are in an hour?", "60", "sixty"),
    ("How many sides does a triangle have?", "3", "three"), ("How many sides does a hexagon have?", "6", "six"),
    ("How many sides does an octagon have?", "8", "eight"), ("How many continents are there?", "7", "seven"),
    ("How many planets are in our solar system?", "8", "eight"), ("How many days are in a leap year?", "366"),
    ("How many players are on a soccer team on the field?", "11", "eleven"),
    ("At what temperature in Celsius does water boil at sea level?", "100"),
    ("At what temperature in Celsius does water freeze?", "0", "zero"),
    ("How many seconds are in a minute?", "60", "sixty"), ("How many centimeters are in a meter?", "100"),
    ("How many grams are in a kilogram?", "1000", "one thousand"), ("How many years are in a century?", "100"),
    ("How many strings does a standard guitar have?", "6", "six"),
    ("What is the largest planet in our solar system?", "Jupiter"), ("Which planet is closest to the Sun?", "Mercury"),
    ("Which planet is known as the Red Planet?", "Mars"), ("What is the largest ocean on Earth?", "Pacific"),
    ("What is the longest river in Africa?", "Nile"), ("What is the tallest mountain in the world?", "Everest"),
    ("What is the largest desert in Africa?", "Sahara"), ("What gas do plants absorb from the air?", "carbon dioxide", "CO2"),
    ("What gas do humans need to breathe to live?", "oxygen"), ("What is the freezing point of water in Fahrenheit?", "32"),
    ("What is the largest mammal?", "blue whale"), ("What is the fastest land animal?", "cheetah"),
    ("What color do you get by mixing blue and yellow?", "green"), ("What color do you get by mixing red and white?", "pink"),
    ("What color do you get by mixing red and yellow?", "orange"), ("What color do you get by mixing blue and red?", "purple", "violet"),
    ("What is the color of a ripe banana?", "yellow"), ("What color is the sky on a clear day?", "blue"),
    ("What is the main language spoken in Brazil?", "Portuguese"), ("What is the main language spoken in Mexico?", "Spanish"),
    ("What language is mainly spoken in Germany?", "German"), ("What language is mainly spoken in Japan?", "Japanese"),
    ("Who painted the Mona Lisa?", "Leonardo", "da Vinci"), ("Who painted The Starry Night?", "Van Gogh"),
    ("Who developed the theory of relativity?", "Einstein"), ("Who discovered penicillin?", "Fleming"),
    ("Who was the first person to walk on the Moon?", "Armstrong"), ("Who invented the telephone?", "Bell"),
    ("Who proposed the laws of motion and universal gravitation?", "Newton"),
    ("Who was the first president of the United States?", "Washington"),
    ("What is the hardest natural substance?", "diamond"), ("What is the chemical formula of water?", "H2O"),
    ("What organ pumps blood through the body?", "heart"), ("What is the largest organ of the human body?", "skin"),
    ("How many bones are in the adult human body?", "206"), ("What is the boiling point of water in Fahrenheit?", "212"),
    ("What do bees make?", "honey"), ("What is a baby cat called?", "kitten"), ("What is a baby dog called?", "puppy"),
    ("What is a baby cow called?", "calf"), ("What animal is known as the king of the jungle?", "lion"),
    ("What is the closest star to Earth?", "Sun"), ("What is Earth's natural satellite called?", "Moon"),
    ("Which continent is Egypt in?", "Africa"), ("Which continent is Brazil in?", "South America"),
    ("Which continent is Japan in?", "Asia"), ("Which continent is France in?", "Europe"),
    ("Which continent is Canada in?", "North America"), ("Which continent is Kenya in?", "Africa"),
    ("Which continent is India in?", "Asia"), ("Which continent is Argentina in?", "South America"),
    ("What is the square root of 81?", "9", "nine"), ("What is the square root of 144?", "12", "twelve"),
    ("How many zeros are in one million?", "6", "six"), ("What is the smallest prime number?", "2", "two"),
    ("In which year did World War II end?", "1945"), ("In which year did World War I begin?", "1914"),
    ("In which year did the Berlin Wall fall?", "1989"), ("In which year did humans first land on the Moon?", "1969"),
    ("What is the currency symbol $ called?", "dollar"), ("What shape has four equal sides and four right angles?", "square"),
    ("What is frozen water called?", "ice"), ("What is the opposite of north on a compass?", "south"),
    ("Which metal is liquid at room temperature?", "mercury"), ("What force keeps us on the ground?", "gravity"),
)
