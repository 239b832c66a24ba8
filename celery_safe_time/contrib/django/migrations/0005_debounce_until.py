# A debounced row's cap (first call plus the max wait); NULL on every other row.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('celery_safe_time', '0004_delay_updated_at_index'),
    ]

    operations = [
        migrations.AddField(
            model_name='delayedtask',
            name='debounce_until',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
