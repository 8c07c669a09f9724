"""The eight chat prompts of the batch figures: benchmarks/perf.py's batch runs and service_throughput.py's bursts
send the same work. Imported by name, as the scripts import their siblings."""

BATCH_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is and when to use one.",
    "Write a Python class for a stack with push, pop and peek.",
    "Describe the water cycle in a few paragraphs.",
    "Write a function that returns the n-th prime number in Python.",
    "What are the advantages of unit tests? Answer in prose.",
    "Write a SQL query that finds the top 5 customers by total order value.",
    "Write a bash script that counts lines in every .py file of a folder.",
]
