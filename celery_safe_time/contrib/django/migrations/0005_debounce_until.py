# A debounced row's cap (first call plus the max wait); NULL on every other row.

from django.db import migrations, models

from celery_safe_time.contrib.django import adopt


class Migration(migrations.Migration):

    dependencies = [
        ('celery_safe_time', '0004_delay_updated_at_index'),
    ]

    operations = [
        adopt.AddField(
            model_name='delayedtask',
            name='debounce_until',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
