"""disttrace: did this distributed run compute the same thing as the reference, and if not, where first?"""

__version__ = "0.1.0"
