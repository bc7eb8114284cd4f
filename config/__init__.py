"""Settings and logging: built once in ``main()`` and passed down."""
