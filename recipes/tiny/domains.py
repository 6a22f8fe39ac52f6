"""The domains of generic tool use: what a tool does, its parameters, how a request says it.

A domain is a kind of tool (a weather lookup, a customer record, a unit conversion); a tool drawn
from it gets one of the domain's names, its description and a random subset of its optional
parameters. Whole domains are held out (`HELDOUT_DOMAINS`): the evaluation's tools have names,
descriptions, parameter names and request phrases training never saw. `{v}` in a phrase is where
the primary value goes; other values follow as "with <parameter words> <value>".
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # a values.draw kind, "enum", "bool" or "object"
    options: tuple[str, ...] = ()  # enum options
    fields: tuple[tuple[str, str], ...] = ()  # an object's (name, kind) fields


@dataclass(frozen=True)
class Domain:
    key: str
    kind: str  # "query": phrases are noun phrases ("the weather in {v}"); "action": verb phrases
    names: tuple[str, ...]
    description: str
    primary: tuple[str, ...]  # name options of the required first parameter
    primary_kind: str
    phrases: tuple[str, ...]
    extras: tuple[Param, ...] = field(default=())
    results: tuple[tuple[str, str], ...] = (("result", "int"),)  # a query result's (field, kind)


def E(name: str, *options: str) -> Param:
    return Param(name, "enum", options)


def O(name: str, *fields: tuple[str, str]) -> Param:  # noqa: E743 - an object parameter
    return Param(name, "object", (), fields)


UNITS = ("celsius", "fahrenheit", "kelvin")
LANGUAGES = ("english", "french", "german", "spanish", "japanese", "chinese", "italian")
LENGTHS = ("meters", "feet", "miles", "kilometers", "inches")
Q, A = "query", "action"
D = Domain
DOMAINS: list[Domain] = [
    D("weather", Q, ("get_weather", "current_weather", "weather_lookup"),
      "Get the current weather at a location.",
      ("location", "city", "place"), "place", ("the weather in {v}", "the current weather for {v}"),
      (E("unit", *UNITS), Param("days", "count")), (("condition", "word"), ("temperature", "int"))),
    D("stock", Q, ("get_stock_price", "stock_quote", "fetch_share_price"),
      "Get the latest stock price for a ticker.",
      ("ticker", "symbol"), "ticker", ("the stock price of {v}", "the share price for {v}"),
      (Param("currency", "currency"),), (("price", "number"),)),
    D("capital", Q, ("find_capital", "capital_city"), "Look up the capital city of a country.",
      ("country", "nation"), "place", ("the capital of {v}", "the capital city of {v}"), (),
      (("capital", "place"),)),
    D("population", Q, ("get_population", "population_of"), "Return the population of a city or country.",
      ("place", "region"), "place", ("the population of {v}", "how many people live in {v}"),
      (Param("year", "count"),), (("population", "int"),)),
    D("timezone", Q, ("get_timezone", "local_time"), "Tell the local time and time zone of a city.",
      ("city", "location"), "place", ("the local time in {v}", "the time zone of {v}"), (),
      (("time", "date"),)),
    D("define", Q, ("define_word", "dictionary_lookup", "lookup_word"),
      "Look up the meaning of a word in the dictionary.",
      ("word", "term"), "word", ("the meaning of the word {v}", "the dictionary definition of {v}"),
      (E("language", *LANGUAGES),), (("definition", "text"),)),
    D("letters", Q, ("count_letters", "letter_counter"), "Count how many times a letter appears in a word.",
      ("word", "text"), "word", ("how often a letter appears in {v}", "the letter count of {v}"),
      (Param("letter", "letter"),), (("count", "count"),)),
    D("translate", A, ("translate_text", "translator"), "Translate text into another language.",
      ("text", "source_text"), "text", ("translate {v}", "translate the text {v}"),
      (E("target_language", *LANGUAGES), E("source_language", *LANGUAGES)), (("translation", "text"),)),
    D("temperature", A, ("convert_temperature", "temp_convert"), "Convert a temperature between units.",
      ("value", "temperature", "degrees"), "number", ("convert {v} degrees", "convert the temperature {v}"),
      (E("from_unit", *UNITS), E("to_unit", *UNITS)), (("converted", "number"),)),
    D("length", A, ("convert_length", "unit_converter"), "Convert a length from one unit to another.",
      ("amount", "length", "value"), "number", ("convert {v} of length", "convert the length {v}"),
      (E("from_unit", *LENGTHS), E("to_unit", *LENGTHS)), (("converted", "number"),)),
    D("currency", A, ("convert_currency", "exchange_money"),
      "Convert an amount of money to another currency.",
      ("amount", "value"), "number", ("convert {v} in money", "exchange the amount {v}"),
      (Param("from_currency", "currency"), Param("to_currency", "currency")), (("converted", "number"),)),
    D("customer", A, ("create_customer", "add_customer", "new_client"), "Create a customer record.",
      ("customer_name", "name", "client_name"),
      "text", ("create a customer named {v}", "add a new customer called {v}"),
      (Param("description", "text"), Param("email", "email"), Param("vip", "bool"))),
    D("reminder", A, ("set_reminder", "create_reminder"), "Set a reminder with a message.",
      ("message", "note"), "text", ("set a reminder saying {v}", "remind me {v}"),
      (Param("minutes", "count"), Param("urgent", "bool"))),
    D("email", A, ("send_email", "email_send", "mail_message"), "Send an email to a recipient.",
      ("recipient", "to"), "email", ("send an email to {v}", "email {v}"),
      (Param("subject", "text"), Param("high_priority", "bool"))),
    D("order", Q, ("get_order_status", "order_lookup", "track_order"), "Check the status of an order.",
      ("order_id", "order_number"), "code", ("the status of order {v}", "where my order {v} is"),
      (Param("include_items", "bool"),), (("status", "word"),)),
    D("flight", A, ("book_flight", "search_flights", "find_flight"),
      "Search or book a flight between two cities.",
      ("origin", "from_city"), "place", ("book a flight from {v}", "find flights leaving {v}"),
      (Param("destination", "place"), Param("date", "date"), E("cabin", "economy", "business", "first"))),
    D("hotel", A, ("book_hotel", "reserve_room"), "Book a hotel room in a city.",
      ("city", "location"), "place", ("book a hotel in {v}", "reserve a room in {v}"),
      (Param("nights", "count"), Param("guests", "count"), Param("breakfast", "bool"))),
    D("recipe", Q, ("find_recipe", "recipe_search"), "Find a recipe for a dish.",
      ("dish", "ingredient"), "word", ("a recipe for {v}", "recipes with {v}"),
      (Param("servings", "count"), Param("vegetarian", "bool")), (("recipe", "text"),)),
    D("book", Q, ("search_books", "find_book"), "Search the library for a book by title.",
      ("title", "query"), "text", ("the book titled {v}", "books called {v}"),
      (Param("author", "person"), Param("max_results", "count")), (("found", "count"),)),
    D("song", A, ("play_song", "play_music"), "Play a song on the speaker.",
      ("song", "title", "track"), "text", ("play the song {v}", "put on {v}"),
      (Param("artist", "person"), Param("volume", "count"), Param("shuffle", "bool"))),
    D("sqrt", Q, ("square_root", "compute_sqrt"), "Compute the square root of a number.",
      ("number", "x", "value"), "number", ("the square root of {v}", "the root of {v}"), (),
      (("root", "number"),)),
    D("factorial", Q, ("factorial", "compute_factorial"), "Compute the factorial of an integer.",
      ("n", "number"), "count", ("the factorial of {v}", "{v} factorial"), (), (("factorial", "int"),)),
    D("prime", Q, ("is_prime", "check_prime"), "Check whether an integer is a prime number.",
      ("n", "number", "value"), "int", ("whether {v} is prime", "if {v} is a prime number"), (),
      (("prime", "bool"),)),
    D("words", Q, ("count_words", "word_count"), "Count the words in a text.",
      ("text", "sentence"), "text", ("how many words are in {v}", "the word count of {v}"), (),
      (("words", "count"),)),
    D("password", A, ("generate_password", "make_password"), "Generate a random password.",
      ("length", "size"), "count", ("generate a password of length {v}", "make a {v} character password"),
      (Param("symbols", "bool"), Param("digits", "bool"))),
    D("random", Q, ("random_number", "roll_number"), "Draw a random integer between two bounds.",
      ("low", "minimum"), "int", ("a random number from {v}", "a random integer above {v}"),
      (Param("high", "int"),), (("number", "int"),)),
    D("tip", Q, ("calculate_tip", "tip_calculator"), "Calculate the tip on a bill.",
      ("bill", "amount"), "number", ("the tip on a bill of {v}", "the tip for {v}"),
      (Param("percent", "count"), Param("split", "count")), (("tip", "number"),)),
    D("news", Q, ("get_news", "news_headlines", "latest_news"), "Get the latest news headlines on a topic.",
      ("topic", "subject"), "word", ("the latest news about {v}", "news headlines on {v}"),
      (Param("limit", "count"), E("language", *LANGUAGES)), (("headline", "text"),)),
    D("file", Q, ("read_file", "open_file"), "Read a file from disk.",
      ("path", "filename"), "word", ("the contents of the file {v}", "what is in the file {v}"),
      (Param("max_lines", "count"),), (("content", "text"),)),
    D("user", Q, ("get_user", "lookup_user", "user_profile"), "Look up a user profile by username.",
      ("username", "user"), "word", ("the profile of user {v}", "the account of {v}"),
      (Param("include_posts", "bool"),), (("name", "person"), ("age", "count"))),
    D("package", Q, ("track_package", "parcel_status"), "Track a package by its tracking number.",
      ("tracking_number", "tracking_id"), "code", ("where package {v} is", "the tracking status of {v}"),
      (E("carrier", "ups", "fedex", "dhl", "usps"),), (("status", "word"), ("location", "place"))),
    D("address", A, ("save_address", "update_address"), "Save a shipping address for a customer.",
      ("customer_name", "name"), "person", ("save an address for {v}", "update the address of {v}"),
      (O("address", ("street", "text"), ("city", "place")), Param("default", "bool"))),
    D("meeting", A, ("schedule_meeting", "create_event", "book_meeting"),
      "Schedule a meeting in the calendar.",
      ("title", "topic"),
      "text", ("schedule a meeting about {v}", "put a meeting called {v} in the calendar"),
      (Param("date", "date"),
      Param("duration_minutes", "count"), O("room", ("building", "word"), ("floor", "count")))),
    D("area", Q, ("rectangle_area", "compute_area"), "Compute the area of a rectangle.",
      ("width", "length"), "count", ("the area of a rectangle of width {v}", "the area for width {v}"),
      (Param("height", "count"),), (("area", "int"),)),
    D("distance", Q, ("get_distance", "distance_between", "route_length"),
      "Get the distance between two places.",
      ("origin", "start"), "place", ("the distance from {v}", "how far it is from {v}"),
      (Param("destination", "place"), E("unit", "km", "miles")), (("distance", "number"),)),
    D("exchange", Q, ("exchange_rate", "get_fx_rate"), "Get the exchange rate between two currencies.",
      ("base", "from_currency"), "currency", ("the exchange rate of {v}", "the rate for {v}"),
      (Param("quote", "currency"),), (("rate", "number"),)),
    D("bmi", Q, ("compute_bmi", "body_mass_index"), "Compute the body mass index.",
      ("weight_kg", "weight"), "number", ("the bmi for a weight of {v}", "the body mass index at {v} kg"),
      (Param("height_cm", "count"),), (("bmi", "number"),)),
    D("playlist", A, ("create_playlist", "new_playlist"), "Create a music playlist.",
      ("playlist_name", "name"), "text", ("create a playlist named {v}", "make a new playlist called {v}"),
      (Param("public", "bool"), E("genre", "jazz", "rock", "pop", "classical"))),
    D("invoice", A, ("create_invoice", "bill_customer"), "Create an invoice for a customer.",
      ("customer_id", "client_id"), "count", ("create an invoice for customer {v}", "bill customer {v}"),
      (Param("amount", "number"), Param("paid", "bool"), Param("currency", "currency"))),
    D("timer", A, ("start_timer", "set_timer"), "Start a countdown timer.",
      ("seconds", "duration"), "count", ("start a timer for {v} seconds", "set a timer of {v} seconds"),
      (Param("label", "text"),)),
    D("lights", A, ("set_lights", "control_lights", "switch_lights"), "Turn the lights in a room on or off.",
      ("room", "area"), "word", ("switch the lights in the {v}", "control the lights of the {v}"),
      (Param("on", "bool"), Param("brightness", "count"))),
    D("search", Q, ("web_search", "search_web", "internet_search"), "Search the web for a query.",
      ("query", "q", "search_terms"), "text", ("search results for {v}", "what the web says about {v}"),
      (Param("max_results", "count"),), (("top_result", "text"),)),
]  # fmt: skip

# Whole domains the evaluation keeps for itself: the temperature conversion, stock price,
# translation and letter counting plus tools of every shape (enum, bool, nested object, two places).
HELDOUT_DOMAINS = {"temperature", "stock", "translate", "letters", "timezone", "email", "hotel", "bmi",
                   "meeting", "distance", "playlist", "search"}  # fmt: skip
