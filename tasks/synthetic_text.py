"""The words of the synthetic text-to-SQL task: its domains, its question templates and each template's slip.

Invariants:
- Every domain has the same shape (an entity table with a place and a year, an item table with a category
  and a number, a fact table linking them with a quantity and a date), so one template set serves all of
  them with domain words swapped in.
- Every template has a slip (SLIPS, same index): SQL that runs and returns other rows than the gold
  query; the slip of a gold query is recovered from its text alone (`slipped`), whatever the values
  (the domains' own words or a value pool's made-up ones: only the identifiers name the domain).
- Pure data and pure functions: no I/O, no randomness (tasks/synthetic.py builds databases and splits).
"""
from __future__ import annotations

import re
import string

FIRST_NAMES = ["Ada", "Ben", "Cleo", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jon", "Kira", "Liam",
          "Maya", "Nils", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wes", "Yara", "Zane"]
LAST_NAMES = ["Abbott", "Brooks", "Castro", "Diaz", "Evans", "Fischer", "Garcia", "Hansen", "Ito", "Jensen",
         "Khan", "Lopez", "Moreau", "Novak", "Olsen", "Park", "Quist", "Rossi", "Silva", "Tanaka"]

# Domain words: entity table (with a place and a year), item table (with a category and a number),
# fact table (entity x item, with a quantity and a date).
DOMAINS = [
    dict(domain="retail",
         entity="customers", entity_one="customer", e_id="customer_id", place="city", place_word="city",
         places=["Oslo", "Lima", "Pune", "Kyoto", "Austin", "Porto", "Cairo", "Quito", "Riga", "Accra", "Hanoi", "Bonn", "Dakar", "Perth", "Oaxaca", "Tunis"],
         year="signup_year", year_phrase="signed up", years=(2015, 2024), place_verb="live in",
         item="products", item_one="product", i_id="product_id", cat="category", cat_word="category",
         cats=["Books", "Garden", "Toys", "Kitchen", "Sports", "Music", "Games", "Tools"],
         num="price", num_word="price", num_range=(2, 400), item_words=["Lamp", "Kettle", "Ball", "Novel", "Rake", "Drum", "Puzzle", "Pan", "Racket", "Vase"],
         fact="orders", fact_one="order", f_id="order_id", qty="quantity", qty_word="quantity ordered",
         date="order_date", fact_verb="ordered"),
    dict(domain="school",
         entity="students", entity_one="student", e_id="student_id", place="hometown", place_word="hometown",
         places=["Bergen", "Leeds", "Graz", "Turin", "Dayton", "Nantes", "Hobart", "Malmo", "Ghent", "Delft", "Tromso", "Split", "Aalborg", "Bruges", "Cusco", "Padua"],
         year="enrollment_year", year_phrase="enrolled", years=(2016, 2024), place_verb="come from",
         item="courses", item_one="course", i_id="course_id", cat="department", cat_word="department",
         cats=["Physics", "History", "Biology", "Art", "Economics", "Math", "Music", "Law"],
         num="credits", num_word="credits", num_range=(1, 10), item_words=["Optics", "Genetics", "Painting", "Algebra", "Trade", "Empires", "Ecology", "Logic", "Sculpture", "Markets"],
         fact="enrollments", fact_one="enrollment", f_id="enrollment_id", qty="score", qty_word="score",
         date="term_start", fact_verb="took"),
    dict(domain="library",
         entity="members", entity_one="member", e_id="member_id", place="district", place_word="district",
         places=["Northgate", "Riverside", "Oldtown", "Hillcrest", "Harbor", "Westfield", "Elmwood", "Bayview", "Fairmont", "Redhill", "Lakeside", "Southend", "Greenway", "Millbrook", "Ashford", "Kingsley"],
         year="join_year", year_phrase="joined", years=(2010, 2024), place_verb="live in",
         item="books", item_one="book", i_id="book_id", cat="genre", cat_word="genre",
         cats=["Mystery", "Poetry", "Science", "Fantasy", "Travel", "Cooking", "Drama", "Crafts"],
         num="pages", num_word="page count", num_range=(80, 900), item_words=["Atlas", "Saga", "Diary", "Guide", "Almanac", "Chronicle", "Primer", "Ballads", "Letters", "Tales"],
         fact="loans", fact_one="loan", f_id="loan_id", qty="days", qty_word="loan days",
         date="loan_date", fact_verb="borrowed"),
    dict(domain="clinic",
         entity="patients", entity_one="patient", e_id="patient_id", place="city", place_word="city",
         places=["Dublin", "Perth", "Lyon", "Basel", "Denver", "Seville", "Tampere", "Cork", "Bilbao", "Aarhus", "Graz", "Nice", "Malaga", "Bremen", "Leiden", "Bergamo"],
         year="birth_year", year_phrase="were born", years=(1950, 2015), place_verb="live in",
         item="treatments", item_one="treatment", i_id="treatment_id", cat="specialty", cat_word="specialty",
         cats=["Cardiology", "Dermatology", "Neurology", "Oncology", "Pediatrics", "Radiology", "Urology", "Surgery"],
         num="cost", num_word="cost", num_range=(50, 5000), item_words=["Scan", "Therapy", "Screening", "Biopsy", "Infusion", "Checkup", "Imaging", "Consult", "Graft", "Panel"],
         fact="visits", fact_one="visit", f_id="visit_id", qty="duration", qty_word="visit minutes",
         date="visit_date", fact_verb="received"),
]

# (difficulty, question, gold SQL, evidence). {E}/{I}/{F}: table names; other fields from DOMAINS;
# {v_*}: slot values drawn from the database.
TEMPLATES = [
    ("simple", "How many {entity} {place_verb} {v_place}?",
     "SELECT COUNT(*) FROM {entity} WHERE {place} = '{v_place}'",
     "{place_verb} {v_place} refers to {place} = '{v_place}'"),
    ("simple", "List the names of {item} in the {v_cat} {cat_word}.",
     "SELECT name FROM {item} WHERE {cat} = '{v_cat}'",
     "{v_cat} {cat_word} refers to {cat} = '{v_cat}'"),
    ("simple", "What is the {num_word} of the {item_one} named {v_item}?",
     "SELECT {num} FROM {item} WHERE name = '{v_item}'",
     "{num_word} refers to {num}"),
    ("simple", "How many {entity} {year_phrase} after {v_year}?",
     "SELECT COUNT(*) FROM {entity} WHERE {year} > {v_year}",
     "{year_phrase} after {v_year} refers to {year} > {v_year}"),
    ("moderate", "How many {fact} were made by {entity} who {place_verb} {v_place}?",
     "SELECT COUNT(*) FROM {fact} AS T1 INNER JOIN {entity} AS T2 ON T1.{e_id} = T2.{e_id} WHERE T2.{place} = '{v_place}'",
     "{place_verb} {v_place} refers to {place} = '{v_place}'"),
    ("moderate", "What is the average {num_word} of {item} in the {v_cat} {cat_word}?",
     "SELECT AVG({num}) FROM {item} WHERE {cat} = '{v_cat}'",
     "average {num_word} = AVG({num})"),
    ("moderate", "Which {place_word} has the most {entity}?",
     "SELECT {place} FROM {entity} GROUP BY {place} ORDER BY COUNT(*) DESC LIMIT 1",
     "the most {entity} refers to MAX(COUNT({e_id}))"),
    ("moderate", "List the distinct names of {entity} who {fact_verb} {v_item}.",
     "SELECT DISTINCT T2.name FROM {fact} AS T1 INNER JOIN {entity} AS T2 ON T1.{e_id} = T2.{e_id} "
     "INNER JOIN {item} AS T3 ON T1.{i_id} = T3.{i_id} WHERE T3.name = '{v_item}'",
     "{v_item} refers to {item}.name = '{v_item}'"),
    ("challenging", "Which {cat_word} values have more than {v_n} {item}?",
     "SELECT {cat} FROM {item} GROUP BY {cat} HAVING COUNT(*) > {v_n}",
     "more than {v_n} {item} refers to COUNT({i_id}) > {v_n}"),
    ("challenging", "What is the total {qty_word} of {v_cat} {item} for {entity} who {place_verb} {v_place}?",
     "SELECT SUM(T1.{qty}) FROM {fact} AS T1 INNER JOIN {entity} AS T2 ON T1.{e_id} = T2.{e_id} "
     "INNER JOIN {item} AS T3 ON T1.{i_id} = T3.{i_id} WHERE T3.{cat} = '{v_cat}' AND T2.{place} = '{v_place}'",
     "total {qty_word} = SUM({qty}); {v_cat} refers to {cat} = '{v_cat}'"),
    ("challenging", "List the names of the top {v_k} {entity} by total {qty_word}.",
     "SELECT T2.name FROM {fact} AS T1 INNER JOIN {entity} AS T2 ON T1.{e_id} = T2.{e_id} "
     "GROUP BY T1.{e_id} ORDER BY SUM(T1.{qty}) DESC LIMIT {v_k}",
     "total {qty_word} = SUM({qty})"),
    ("challenging", "In {v_fyear}, which {item_one} had the highest total {qty_word}?",
     "SELECT T2.name FROM {fact} AS T1 INNER JOIN {item} AS T2 ON T1.{i_id} = T2.{i_id} "
     "WHERE strftime('%Y', T1.{date}) = '{v_fyear}' GROUP BY T1.{i_id} ORDER BY SUM(T1.{qty}) DESC LIMIT 1",
     "in {v_fyear} refers to strftime('%Y', {date}) = '{v_fyear}'; highest total {qty_word} refers to MAX(SUM({qty}))"),
]

# A systematic slip per template (same index): SQL that runs but answers another question (a wrong
# operator, column, aggregate or order), as a careless annotator writes it. The tiny recipe's warm start
# learns from targets that are sometimes slipped (launch/warm_start.py), so its policy samples the right
# answer only part of the time: reward RL can find.
SLIPS = [
    "SELECT COUNT(*) FROM {entity} WHERE {place} != '{v_place}'",
    "SELECT {i_id} FROM {item} WHERE {cat} = '{v_cat}'",
    "SELECT {i_id} FROM {item} WHERE name = '{v_item}'",
    "SELECT COUNT(*) FROM {entity} WHERE {year} >= {v_year}",
    "SELECT COUNT(DISTINCT T1.{e_id}) FROM {fact} AS T1 INNER JOIN {entity} AS T2 ON T1.{e_id} = T2.{e_id} "
    "WHERE T2.{place} = '{v_place}'",
    "SELECT SUM({num}) FROM {item} WHERE {cat} = '{v_cat}'",
    "SELECT {place} FROM {entity} GROUP BY {place} ORDER BY COUNT(*) ASC LIMIT 1",
    "SELECT DISTINCT T3.name FROM {fact} AS T1 INNER JOIN {entity} AS T2 ON T1.{e_id} = T2.{e_id} "
    "INNER JOIN {item} AS T3 ON T1.{i_id} = T3.{i_id} WHERE T3.name = '{v_item}'",
    "SELECT {cat} FROM {item} GROUP BY {cat} HAVING COUNT(*) < {v_n}",
    "SELECT SUM(T1.{qty}) FROM {fact} AS T1 INNER JOIN {entity} AS T2 ON T1.{e_id} = T2.{e_id} "
    "INNER JOIN {item} AS T3 ON T1.{i_id} = T3.{i_id} WHERE T3.{cat} != '{v_cat}' AND T2.{place} = '{v_place}'",
    "SELECT T2.name FROM {fact} AS T1 INNER JOIN {entity} AS T2 ON T1.{e_id} = T2.{e_id} "
    "GROUP BY T1.{e_id} ORDER BY SUM(T1.{qty}) ASC LIMIT {v_k}",
    "SELECT T2.name FROM {fact} AS T1 INNER JOIN {item} AS T2 ON T1.{i_id} = T2.{i_id} "
    "WHERE strftime('%Y', T1.{date}) = '{v_fyear}' GROUP BY T1.{i_id} ORDER BY SUM(T1.{qty}) ASC LIMIT 1",
]
assert len(SLIPS) == len(TEMPLATES)

# The tiny recipe's templates: those whose gold SQL fits its 48-token answers (the three-table joins
# and the top-k query need 60-83 tokens of the tiny tokenizer) and whose value is one short word
# (a 2-layer model does not learn to copy the two-word item names in minutes).
TINY_TEMPLATES = (0, 1, 3, 4, 5, 6, 8)



def _pattern(sql_template: str) -> re.Pattern:
    """A template's SQL as a regex: every {slot} a named group (a repeated slot must repeat its value)."""
    out, seen = [], set()
    for literal, name, _, _ in string.Formatter().parse(sql_template):
        out.append(re.escape(literal))
        if name is not None:
            group = ".+?" if name.startswith("v_") else r"\w+"  # values vs domain words (identifiers)
            out.append(f"(?P={name})" if name in seen else f"(?P<{name}>{group})")
            seen.add(name)
    return re.compile("".join(out) + r"\Z")


_PATTERNS = [_pattern(t[2]) for t in TEMPLATES]


def template_of(sql: str) -> int | None:
    """The index of the template a gold query was written from, or None."""
    for i, pattern in enumerate(_PATTERNS):
        if pattern.match(sql):
            return i
    return None


def slipped(sql: str) -> str | None:
    """The template's slip (SLIPS) with the gold query's own slot values and domain words, or None for
    SQL of no template."""
    i = template_of(sql)
    if i is None:
        return None
    slots = _PATTERNS[i].match(sql).groupdict()
    domain = next(d for d in DOMAINS if all(d[k] == v for k, v in slots.items() if k in d))
    return SLIPS[i].format(**{**domain, **slots})
